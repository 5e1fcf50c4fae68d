"""The fused page-boundary path (flush="fused", kernels/flush.py) against the default torch path and the references.

The fused kernels run under TRITON_INTERPRET=1 on a CPU (slow): shapes stay small.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
from conftest import DEVICE, tiny_model
from test_cache import feed
from torch.utils._python_dispatch import TorchDispatchMode

from backend import make_cache, method_config
from backend.cache import KittyLayer
from kernels.flush import flush_key_pages, flush_value_pages
from kernels.layout import SCALE_DTYPE, key_plane_shape, value_plane_shape
from kernels.quantize import choose_boost, quantize_keys_ref, quantize_values_ref

KEY_FIELDS = ("low", "high", "ch", "scale", "zero", "magnitude")
VALUE_FIELDS = ("low", "high", "scale", "zero")


def _buffers(batch, heads, tokens, dim, dtype, seed):
    """Random 16-bit buffers; head 0 has two constant channels (scale 0 for keys, no magnitude tie), the last head a
    constant token (scale 0 for values)."""
    x = torch.randn(batch, heads, tokens, dim, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    x[:, 0, :, 3] = 0.75
    x[:, 0, :, dim - 2] = -1.25
    x[:, -1, 5] = 0.5
    return x


def _empty_pool(pages, shapes):
    return {name: torch.full((pages, *shape), 7, dtype=dtype, device=DEVICE) for name, (shape, dtype) in shapes.items()}


def _indices(*lists):
    return [torch.tensor(values, device=DEVICE) for values in lists]


@pytest.mark.parametrize("dim,n_boost,move,dtype", [(64, 8, 0, torch.float16), (64, 0, 2, torch.bfloat16),
                                                    (128, 32, 2, torch.float16), (128, 128, 0, torch.float16)])
def test_fused_key_flush_equals_the_references(dim, n_boost, move, dtype):
    """Rows 0 and 2 of three get pages 3 and 1 at table columns 0 and 2: every field equals choose_boost +
    quantize_keys_ref on the page's tokens, the table and counts record them, the waiting tokens move down, and
    row 1 (not due) is untouched."""
    sink, g, heads = 4, 16, 2
    fp = _buffers(3, heads, sink + g + move, dim, dtype, seed=dim + n_boost)
    before = fp.clone()
    pool = _empty_pool(5, {"low": (key_plane_shape(heads, g, dim), torch.uint8),
                           "high": (key_plane_shape(heads, g, n_boost), torch.uint8),
                           "ch": ((heads, n_boost), torch.uint8), "scale": ((heads, dim), SCALE_DTYPE),
                           "zero": ((heads, dim), SCALE_DTYPE), "magnitude": ((heads, dim), SCALE_DTYPE)})
    table, counts = torch.full((3, 4), -1, dtype=torch.int32, device=DEVICE), _indices([0, 1, 2])[0].int()
    rows, ids, cols = _indices([0, 2], [3, 1], [0, 2])
    flush_key_pages(fp, rows, ids, cols, pool, table, counts, sink, g, n_boost, move, record_magnitudes=True)
    x = before[rows, :, sink:sink + g]
    ch, magnitude = choose_boost(x, n_boost)
    want = dict(zip(("low", "high", "scale", "zero"), quantize_keys_ref(x, ch, n_boost)), ch=ch,
                magnitude=magnitude.to(SCALE_DTYPE))
    for name in KEY_FIELDS[:-1]:
        assert torch.equal(pool[name][ids], want[name]), name
    # magnitudes are sums in another order than torch's on a GPU: equal up to float32 rounding, kept at FP16
    torch.testing.assert_close(pool["magnitude"][ids], want["magnitude"], rtol=1e-3, atol=0)
    assert (want["scale"] == 0).any()                               # constant channels were among them
    assert table.tolist() == [[3, -1, -1, -1], [-1] * 4, [-1, -1, 1, -1]] and counts.tolist() == [1, 1, 3]
    assert torch.equal(fp[rows, :, sink:sink + move], before[rows, :, sink + g:sink + g + move])
    assert torch.equal(fp[rows, :, :sink], before[rows, :, :sink]) and torch.equal(fp[1], before[1])


@pytest.mark.parametrize("dim,bits,move", [(64, 2, 16), (128, 4, 18), (64, 4, 0)])
def test_fused_value_flush_equals_the_references(dim, bits, move):
    """As for keys: a value window (and waiters) longer than the page overlaps its old place; it moves intact."""
    sink, g, heads = 4, 16, 2
    fp = _buffers(3, heads, sink + g + move, dim, torch.float16, seed=dim + bits)
    before = fp.clone()
    pool = _empty_pool(4, {"low": (value_plane_shape(heads, dim, g), torch.uint8),
                           "high": (value_plane_shape(heads, dim, g, bits == 4), torch.uint8),
                           "scale": ((heads, g), SCALE_DTYPE), "zero": ((heads, g), SCALE_DTYPE)})
    table, counts = torch.full((3, 2), -1, dtype=torch.int32, device=DEVICE), torch.zeros(3, dtype=torch.int32,
                                                                                         device=DEVICE)
    rows, ids, cols = _indices([1, 2], [0, 2], [0, 1])
    flush_value_pages(fp, rows, ids, cols, pool, table, counts, sink, g, bits, move)
    want = quantize_values_ref(before[rows, :, sink:sink + g], bits)
    for name, expected in zip(VALUE_FIELDS, want):
        assert torch.equal(pool[name][ids], expected), name
    assert (want[2] == 0).any()                                     # a constant token
    assert table.tolist() == [[-1, -1], [0, -1], [-1, 2]] and counts.tolist() == [0, 1, 1]
    assert torch.equal(fp[rows, :, sink:sink + move], before[rows, :, sink + g:sink + g + move])
    assert torch.equal(fp[0], before[0])


def _state(cache) -> list[dict]:
    """Everything a step leaves in each layer: host bookkeeping, device tables and counts, full-precision buffers, and
    every sequence's pages (all fields, found through its page table)."""
    states = []
    for layer in cache.layers:
        state = dict(lengths=layer.lengths.tolist(), seq_len=layer.seq_len.tolist(), k_fp=layer.k_fp.clone(),
                     v_fp=layer.v_fp.clone())
        for kind, pool, table, fields in (("key", layer.key_pool, layer.key_table, KEY_FIELDS),
                                          ("value", layer.value_pool, layer.value_table, VALUE_FIELDS)):
            state[kind] = dict(counts=table.counts.tolist(), device_counts=table.device_counts.tolist(),
                               ids=table.ids.tolist(), free=list(pool.free), in_use=pool.in_use,
                               capacity=pool.capacity)
            for b in range(layer.batch):
                pages = table.pages_of(b)
                state[kind].update({f"{name}{b}": pool.tensors[name][pages].clone() for name in fields})
        states.append(state)
    return states


def _decode_recording(model, ids, mask, prefix, cache) -> tuple[torch.Tensor, list]:
    """feed()'s per-step logits and the cache's _state after every decode step."""
    states = []
    logits = feed(model, ids, cache, prefix, mask, on_step=lambda c: states.append(_state(c)))
    return logits, states


def _assert_same(got, want, where=""):
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor) and ".magnitude" in where:
        # a float32 sum in another order on a GPU (the Triton kernel vs torch's norm), kept at FP16: rounding apart
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0, msg=where)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


# per method, every pair of (head_dim, GQA ratio, flush_spread) values once
CASES = [(method, dim, group, spread) for method in ("kitty", "kitty-pro", "kivi-k2v2", "kivi-k4v4")
         for dim, group, spread in ((64, 1, 1), (128, 4, 1), (64, 4, 3), (128, 1, 3))]


@pytest.mark.parametrize("method,dim,group,spread", CASES)
def test_fused_flush_leaves_the_same_cache_as_the_torch_path(method, dim, group, spread):
    """A left-padded batch of three, two of the same length, decoded token by token (crossing key pages, the value
    window and value pages; with flush_spread = 3 one of the two equal buffers waits a step for its turn): after every
    step both paths hold the same pages (all fields), tables, buffers and host bookkeeping, and the same logits."""
    pads, width, prefix, sink, g = [0, 0, 9], 76, 20, 4, 16
    cfg = method_config(method, page_size=g, local_window=16, sink=sink)
    model = tiny_model(heads=2 * group, kv_heads=2, head_dim=dim, layers=1)
    ids = torch.randint(3, 256, (3, width), generator=torch.Generator().manual_seed(dim + group))
    mask = (torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]).long()
    runs = {flush: _decode_recording(model, ids, mask, prefix, make_cache(model, cfg, flush_spread=spread, flush=flush))
            for flush in ("torch", "fused")}
    states = runs["fused"][1]
    assert sum(states[-1][0]["key"]["counts"]) > 3                  # pages were made by decode steps
    waited = [max(np.array(s[0]["lengths"]) - sink - np.array(s[0]["key"]["counts"]) * g) >= g for s in states]
    assert any(waited) == (spread > 1)
    assert torch.equal(runs["fused"][0], runs["torch"][0])
    _assert_same(runs["fused"][1], runs["torch"][1])


def test_flush_modes_are_validated_and_other_selections_keep_the_torch_path():
    model = tiny_model(layers=1)
    with pytest.raises(ValueError, match="flush='triton' must be one of"):
        make_cache(model, "kitty", flush="triton")
    def fused(cfg, flush="fused", device=DEVICE, use_triton=None) -> bool:
        layer = KittyLayer(cfg, use_triton=use_triton, flush=flush)
        layer.lazy_initialization(torch.zeros(1, 2, 1, 64, device=device), torch.zeros(1, 2, 1, 64, device=device))
        return layer._fused_flush()

    assert all(fused(method_config(method)) for method in ("kitty", "kitty-pro", "kivi-k2v2", "kivi-k4v4"))
    assert fused(method_config("kivi-k4v4", selection="random"))           # all channels boosted: nothing drawn
    assert not any(fused(method_config("kitty", selection=selection)) for selection in ("random", "query"))
    assert not fused(method_config("kitty"), flush="torch")
    # the default: fused for a cache on a GPU, torch on a CPU (where Triton would run interpreted)
    assert KittyLayer(method_config("kitty")).flush == "auto"
    assert not fused(method_config("kitty"), flush="auto", device="cpu")
    if torch.cuda.is_available():
        assert fused(method_config("kitty"), flush="auto", device="cuda")
        assert not fused(method_config("kitty"), flush="auto", device="cuda", use_triton=False)


class _Launches(TorchDispatchMode):
    """Counts torch ops (non-view, as on a GPU each launches a kernel) and Triton launches, not the torch ops the
    interpreter runs inside a launch."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops, self.triton, self.inside = 0, 0, False
        launch = triton.runtime.interpreter.InterpretedFunction.run

        def counted(kernel, *args, **kwargs):
            self.triton += 1
            self.inside = True
            try:
                return launch(kernel, *args, **kwargs)
            finally:
                self.inside = False
        monkeypatch.setattr(triton.runtime.interpreter.InterpretedFunction, "run", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreted Triton launches")
def test_fused_flush_launches_far_fewer_kernels_at_a_page_boundary(monkeypatch):
    """One layer's page-boundary work at steady state (a key and a value page for each of 4 sequences, kitty; pools
    reserved and page tables with room, as in a long run): the torch path issues ~38 kernels, the fused one its 2
    Triton launches and the index copy (and its split)."""
    from conftest import REPORT
    from test_cache import _attend
    cfg = method_config("kitty", page_size=16, local_window=16, sink=4)
    q, k, v = (torch.randn(4, 2, 4 + 3 * 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    counts = {}
    for flush in ("torch", "fused"):
        layer = KittyLayer(cfg, use_triton=True, reserve_tokens=q.shape[2], flush=flush)
        _attend(layer, q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
        for table in (layer.key_table, layer.value_table):          # room for a page more (slots grows the table)
            table.slots(np.arange(4))
        layer._insert_one(k[:, :, -1], v[:, :, -1])                 # the 16th token of both buffers' last page
        with _Launches(monkeypatch) as launches:
            layer._quantize_full_buffers()
        assert layer.key_table.counts.tolist() == [3] * 4 and layer.value_table.counts.tolist() == [2] * 4
        counts[flush] = launches.ops, launches.triton
    REPORT.append(f"page-boundary kernels per layer (torch ops + Triton launches): torch path {counts['torch']}, "
                  f"fused {counts['fused']}")
    assert counts["fused"][1] == 2 and counts["fused"][0] <= 1
    assert sum(counts["torch"]) >= 8 * sum(counts["fused"])
