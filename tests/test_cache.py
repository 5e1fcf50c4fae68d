"""The KittyCache inside transformers' generate, on small random-weight models of each supported family.

Layer 0's keys and values depend only on the embeddings, so a run through KittyCache and one through
DynamicCache see the same layer-0 tokens: that lets these tests check the cache's content exactly (what is in
the sink, which tokens became which page, what stays in the buffers) rather than only its outputs.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import DEVICE, Fp16DynamicCache, tiny_model
from transformers import DynamicCache

import backend.cache
import kernels.decode_attention
from backend import make_cache, memory, method_config
from backend.cache import KittyLayer
from backend.pages import DeviceIndices, PagePool, occurrence_rank, ragged_ranges
from kernels.dequantize import dequantize_keys_ref
from kernels.layout import boost_mask
from kernels.quantize import choose_boost, quantize_keys_ref, quantize_values_ref


def feed(model, ids: torch.Tensor, cache, prefix: int, mask: torch.Tensor | None = None, on_step=None):
    """Prefill `prefix` tokens, then the rest one decode step at a time (teacher forcing); per-step logits.
    With a (left-padding) mask, positions count real tokens only, as generate() computes them.
    on_step(cache) runs after every decode step."""
    ids = ids.to(model.device)
    mask = torch.ones_like(ids) if mask is None else mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids[:, :prefix], attention_mask=mask[:, :prefix], position_ids=positions[:, :prefix],
                    past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for i in range(prefix, ids.shape[1]):
            out = model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], position_ids=positions[:, i:i + 1],
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            if on_step:
                on_step(cache)
    return torch.stack(logits, 1)


def check_layer_content(layer: KittyLayer, keys: torch.Tensor, values: torch.Tensor, b: int = 0, lag: int = 0):
    """Sequence b of `layer` holds exactly keys/values (H, L, D) at 16 bits: sink, pages (bit for bit, quantized
    from the 16-bit tokens), buffers. The page counts are the paper's schedule's, or up to `lag` tokens behind it
    (a cache with flush_spread = lag + 1)."""
    cfg = layer.config
    assert layer.k_fp.dtype == layer.v_fp.dtype == layer.store_dtype and layer.store_dtype.itemsize == 2
    keys, values = keys.to(layer.store_dtype), values.to(layer.store_dtype)
    s, g, r = cfg.sink, cfg.page_size, cfg.local_window
    length = keys.shape[1]
    assert layer.lengths[b] == length
    sink = min(length, s)
    nkp = (length - sink) // g if cfg.k_bits < 16 else 0
    nvp = max(0, length - sink - r) // g if cfg.v_bits < 16 else 0
    if lag:                                                     # a full buffer may wait up to `lag` steps
        nkp_min = max(0, length - lag - sink) // g if cfg.k_bits < 16 else 0
        nvp_min = max(0, length - lag - sink - r) // g if cfg.v_bits < 16 else 0
        assert nkp_min <= layer.key_table.counts[b] <= nkp and nvp_min <= layer.value_table.counts[b] <= nvp
        nkp, nvp = layer.key_table.counts[b], layer.value_table.counts[b]
    assert layer.key_table.counts[b] == nkp and layer.value_table.counts[b] == nvp
    assert torch.equal(layer.k_fp[b, :, :sink], keys[:, :sink]) and torch.equal(layer.v_fp[b, :, :sink], values[:, :sink])
    k_rest, v_rest = keys[:, s + nkp * g:], values[:, s + nvp * g:]
    assert torch.equal(layer.k_fp[b, :, s:s + k_rest.shape[1]], k_rest)
    assert torch.equal(layer.v_fp[b, :, s:s + v_rest.shape[1]], v_rest)
    pool = layer.key_pool.tensors
    for p, pid in enumerate(layer.key_table.pages_of(b)):
        x = keys[:, s + p * g:s + (p + 1) * g].unsqueeze(0)
        ch, mags = choose_boost(x, layer.n_boost)
        if cfg.selection == "magnitude":
            assert torch.equal(pool["ch"][pid], ch[0])
        assert torch.allclose(pool["magnitude"][pid].float(), mags[0], rtol=1e-3, atol=1e-3)
        expected = quantize_keys_ref(x, pool["ch"][pid].unsqueeze(0), layer.n_boost)
        for name, want in zip(("low", "high", "scale", "zero"), expected):
            assert torch.equal(pool[name][pid], want[0]), f"key page {p}: {name}"
    vpool = layer.value_pool.tensors
    for p, pid in enumerate(layer.value_table.pages_of(b)):
        expected = quantize_values_ref(values[:, s + p * g:s + (p + 1) * g].unsqueeze(0), cfg.v_bits)
        for name, want in zip(("low", "high", "scale", "zero"), expected):
            assert torch.equal(vpool[name][pid], want[0]), f"value page {p}: {name}"


@pytest.mark.parametrize("method", ["kitty", "kitty-pro", "kivi-k2v2", "kivi-k4v2*", "kivi-k2v4*", "kivi-k4v4"])
def test_cache_content_follows_the_paper_step_by_step(method):
    """Prefill 40 tokens, decode 260 more (crossing sink, pages and the value window); check after each phase."""
    cfg = method_config(method, page_size=64, local_window=48)
    model = tiny_model(heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(7))
    reference = DynamicCache(config=model.config)
    feed(model, ids, reference, prefix=40)
    cache = make_cache(model, cfg)
    feed(model, ids[:, :40], cache, prefix=40)
    check_layer_content(cache.layers[0], reference.layers[0].keys[0, :, :40], reference.layers[0].values[0, :, :40])
    feed(model, ids, make_cache(model, cfg), prefix=40)  # a second cache must not disturb anything
    cache = make_cache(model, cfg)
    feed(model, ids, cache, prefix=40)
    check_layer_content(cache.layers[0], reference.layers[0].keys[0], reference.layers[0].values[0])


@pytest.mark.parametrize("use_triton", [False, True])
def test_flush_spread_quantizes_a_batch_over_several_steps_into_the_same_pages(use_triton):
    """flush_spread=3 on 5 sequences whose buffers fill together: at most ceil(5/3) = 2 of them get a page per
    step, none waits more than 2 steps, and after every step each holds exactly its tokens (pages bit for bit,
    late tokens in the buffers). The Triton path (which then reads buffers longer than a page) = the reference."""
    cfg = method_config("kitty", page_size=16, local_window=16, sink=4)
    model = tiny_model(heads=4, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (5, 75), generator=torch.Generator().manual_seed(11))
    reference = DynamicCache(config=model.config)
    feed(model, ids, reference, prefix=10)
    keys, values = reference.layers[0].keys, reference.layers[0].values
    previous, most = [np.zeros(5, dtype=np.int64)] * 2, [0, 0]

    def after_step(cache):
        layer = cache.layers[0]
        for side, table in enumerate((layer.key_table, layer.value_table)):
            most[side] = max(most[side], int((table.counts > previous[side]).sum()))
            previous[side] = table.counts.copy()
        for b in range(5):
            n = int(layer.lengths[b])
            check_layer_content(layer, keys[b, :, :n], values[b, :, :n], b, lag=2)

    cache = make_cache(model, cfg, flush_spread=3, use_triton=False)
    logits = feed(model, ids, cache, prefix=10, on_step=after_step)
    assert most == [2, 2]
    assert cache.layers[0].key_table.counts.tolist() == [4] * 5          # (75 - 4) // 16, all caught up
    if use_triton:
        got = feed(model, ids, make_cache(model, cfg, flush_spread=3, use_triton=True), prefix=10)
        torch.testing.assert_close(got, logits, atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="flush_spread"):
        make_cache(model, cfg, flush_spread=0)


def test_flush_spread_auto_is_the_batchs_spread():
    """flush_spread="auto" takes auto_flush_spread of the batch at the first forward (30 sequences: 2 steps of at
    most 16; up to 16: the paper's schedule) and then runs exactly as that explicit spread."""
    from backend.cache import auto_flush_spread
    assert [auto_flush_spread(b) for b in (1, 16, 17, 32, 33, 204)] == [1, 1, 2, 2, 3, 13]
    cfg = method_config("kitty", page_size=16, local_window=16, sink=4)
    model = tiny_model(heads=4, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (30, 50), generator=torch.Generator().manual_seed(12))
    auto = make_cache(model, cfg, flush_spread="auto", use_triton=False)
    logits = feed(model, ids, auto, prefix=10)
    assert auto.layers[0].flush_spread == 2
    torch.testing.assert_close(logits, feed(model, ids, make_cache(model, cfg, flush_spread=2, use_triton=False),
                                            prefix=10), atol=0, rtol=0)
    with pytest.raises(ValueError, match="auto"):
        make_cache(model, cfg, flush_spread="fast")


def test_long_prompt_is_paged_at_prefill():
    cfg = method_config("kitty", page_size=64, local_window=64)
    model = tiny_model(heads=6, kv_heads=2)
    ids = torch.randint(3, 256, (1, 333), generator=torch.Generator().manual_seed(1))
    reference = DynamicCache(config=model.config)
    cache = make_cache(model, cfg)
    feed(model, ids, reference, prefix=333)
    feed(model, ids, cache, prefix=333)
    layer = cache.layers[0]
    assert layer.key_table.counts == [(333 - 32) // 64] and layer.value_table.counts == [(333 - 32 - 64) // 64]
    check_layer_content(layer, reference.layers[0].keys[0], reference.layers[0].values[0])


def test_fp16_preset_equals_dynamic_cache_bit_for_bit():
    """The fp16 preset is transformers' DynamicCache at 16 bits: bit for bit on a bfloat16 model, and on a
    float32 model the same as a DynamicCache holding FP16-rounded tokens (it stores FP16)."""
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    half = tiny_model(heads=8, kv_heads=2, dtype=torch.bfloat16)
    assert torch.equal(feed(half, ids, DynamicCache(config=half.config), prefix=20),
                       feed(half, ids, make_cache(half, "fp16"), prefix=20))
    model = tiny_model(heads=8, kv_heads=2)
    cache = make_cache(model, "fp16")
    assert torch.equal(feed(model, ids, Fp16DynamicCache(model.config), prefix=20), feed(model, ids, cache, prefix=20))
    assert cache.layers[0].k_fp.dtype == torch.float16


@pytest.mark.parametrize("arch,heads,kv_heads,head_dim", [
    ("llama", 4, 4, 64), ("llama", 9, 3, 64), ("mistral", 8, 2, 128), ("qwen2", 8, 1, 64), ("qwen3", 8, 2, 128),
])
@pytest.mark.parametrize("prompt_len", [20, 350])
def test_generate_works_for_each_family_and_gqa_ratio(arch, heads, kv_heads, head_dim, prompt_len):
    """Greedy and sampled generation, prompts shorter and longer than sink + page + window (32 + 128 + 128)."""
    extra = {"sliding_window": None} if arch == "mistral" else {}     # Mistral-7B-v0.3 style: full attention
    model = tiny_model(arch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **extra)
    ids = torch.randint(3, 256, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len)).to(DEVICE)
    cache = make_cache(model, "kitty")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (1, prompt_len + 12)
    stats = cache.stats()
    assert stats.tokens == [prompt_len + 11] and len(stats.layers) == 2
    assert stats.key_pages == 2 * ((prompt_len + 11 - 32) // 128 if prompt_len > 32 else 0)
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=make_cache(model, "kitty"),
                             max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=0.8, top_k=20,
                             pad_token_id=0)
    assert sampled.shape == (1, prompt_len + 12)
    # a 16-bit custom config runs the same code path with nothing quantized: DynamicCache's tokens exactly
    fp = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0,
                        past_key_values=make_cache(model, "custom", k_bits=16, v_bits=16))
    dyn = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0, past_key_values=Fp16DynamicCache(model.config))
    assert torch.equal(fp, dyn)


def test_batch_of_different_lengths_stores_no_padding():
    """Left-padded batch: each sequence's sink, pages and buffers hold its own tokens only."""
    cfg = method_config("kitty", page_size=64, local_window=32)
    model = tiny_model(heads=4, kv_heads=2)
    lengths = [190, 45, 131]
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 256, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, width - len(s):], mask[b, width - len(s):] = s, 1
    cache = make_cache(model, cfg)
    steps = 70
    new = torch.randint(3, 256, (3, steps), generator=gen)
    feed(model, torch.cat([ids, new], 1), cache, prefix=width, mask=torch.cat([mask, torch.ones_like(new)], 1))
    for b, s in enumerate(seqs):
        single = DynamicCache(config=model.config)
        feed(model, torch.cat([s, new[b]])[None], single, prefix=len(s))
        keys, values = single.layers[0].keys[0], single.layers[0].values[0]
        layer = cache.layers[0]
        assert layer.lengths[b] == len(s) + steps
        # batched and single matmuls may round differently: the sink within float noise, then pages code by code
        torch.testing.assert_close(layer.k_fp[b, :, :32].float(), keys[:, :32], atol=1e-3, rtol=1e-3)   # FP16
        torch.testing.assert_close(layer.v_fp[b, :, :32].float(), values[:, :32], atol=1e-3, rtol=1e-3)
        pages = layer.key_table.pages_of(b)
        assert len(pages) == (len(s) + steps - 32) // 64
        pool = layer.key_pool.tensors
        for p, pid in enumerate(pages):
            x = keys[:, 32 + p * 64:32 + (p + 1) * 64].unsqueeze(0)
            want = quantize_keys_ref(x.half(), pool["ch"][pid].unsqueeze(0), layer.n_boost)
            same = (pool["low"][pid] == want[0][0]).float().mean().item()
            assert same > 0.99, f"sequence {b} page {p}: only {same:.3f} of the packed codes match its own tokens"


def test_decode_on_the_triton_path_never_rebuilds_pages(monkeypatch):
    """use_triton=True (interpreted here) gives the reference path's tokens, and its decode steps read pages
    in the kernel only: the whole-page dequantizers and gather_kv are never called."""
    cfg = method_config("kitty", page_size=32, local_window=32, sink=8)
    model = tiny_model(heads=6, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (2, 90), generator=torch.Generator().manual_seed(5))
    ref_cache = make_cache(model, cfg, use_triton=False)
    expected = feed(model, ids, ref_cache, prefix=70)

    def forbidden(*args, **kwargs):
        raise AssertionError("a decode step rebuilt a full-precision copy of the cache")
    for module, name in [(backend.cache, "decode_attention_ref"), (backend.cache, "dequantize"),
                         (kernels.decode_attention, "gather_kv"), (kernels.decode_attention, "dequantize_keys_ref"),
                         (kernels.decode_attention, "dequantize_values_ref")]:
        monkeypatch.setattr(module, name, forbidden)
    cache = make_cache(model, cfg, use_triton=True)
    got = feed(model, ids, cache, prefix=70)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    layer, ref_layer = cache.layers[0], ref_cache.layers[0]
    for name in ("low", "high", "scale", "zero"):
        assert torch.equal(layer.key_pool.tensors[name], ref_layer.key_pool.tensors[name])


def test_decode_kernel_setting_reaches_every_decode_step_and_bad_values_are_refused(monkeypatch):
    """make_cache(decode_kernel=...) is the kernel each decode step asks decode_attention for (on a CPU "gluon"
    runs the Triton kernel, interpreted: the same tokens as the reference path), a Gluon kernel with experiments
    too; other values are refused, naming the setting."""
    cfg = method_config("kitty", page_size=16, local_window=16, sink=4)
    model = tiny_model(heads=4, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (2, 44), generator=torch.Generator().manual_seed(3))
    expected = feed(model, ids, make_cache(model, cfg, use_triton=False), prefix=40)
    asked, real = [], backend.cache.decode_attention
    monkeypatch.setattr(backend.cache, "decode_attention", lambda *a, **k: asked.append(k["kernel"]) or real(*a, **k))
    got = feed(model, ids, make_cache(model, cfg, use_triton=True, decode_kernel="gluon"), prefix=40)
    assert asked and set(asked) == {"gluon"}
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert make_cache(model, cfg, decode_kernel="gluon-tma+zq-ahead+fold-max").layers[0].decode_kernel == \
        "gluon-tma+zq-ahead+fold-max"
    for bad in ("cuda", "gluon-tma+fold-max", "triton+zq-ahead", None):
        with pytest.raises(ValueError, match="decode_kernel"):
            make_cache(model, cfg, decode_kernel=bad)


def test_the_8bit_kernels_arithmetic_decodes_on_the_reference_path(monkeypatch):
    """make_cache(decode_kernel="gluon-tma-i8k" / "gluon-tma-i8", with experiments or not) without Triton decodes with
    kernels/i8_reference.py (its values rounded only for "gluon-tma-i8"): the logits move off the exact reference's,
    by little; teacher forcing feeds such a cache one token a step (a chunk would be attended exactly:
    analysis.page_lengths)."""
    from backend import analysis
    cfg = method_config("kitty", page_size=16, local_window=16, sink=4)
    model = tiny_model(heads=6, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (2, 80), generator=torch.Generator().manual_seed(3))
    exact = feed(model, ids, make_cache(model, cfg, use_triton=False), prefix=40)
    real = backend.cache.decode_attention_i8_ref
    for kernel, values in (("gluon-tma-i8k", False), ("gluon-tma-i8+zq-ahead", True)):
        asked = []
        monkeypatch.setattr(backend.cache, "decode_attention_i8_ref",
                            lambda *a, **k: asked.append(k["values"]) or real(*a, **k))
        got = feed(model, ids, make_cache(model, cfg, use_triton=False, decode_kernel=kernel), prefix=40)
        assert asked and set(asked) == {values}, kernel
        moved = ((got - exact).norm() / exact.norm()).item()
        assert 0 < moved < 0.02, (kernel, moved)            # measured: 0.13 % and 0.59 %
        assert analysis.page_lengths(make_cache(model, cfg, decode_kernel=kernel), 5, 79) is None
    assert analysis.page_lengths(make_cache(model, cfg), 5, 79)


def test_page_pool_hands_out_ids_in_order_and_ranks_repeated_rows():
    """Pages are taken in order, storage grows on demand, release_all gives every page back; occurrence_rank numbers
    a sequence's repeats (several pages of one sequence in one call), also on the fast path of distinct rows."""
    pool = PagePool({"x": ((2,), torch.uint8)}, "cpu")
    pool.reserve(3)
    assert pool.capacity == 3 and list(pool.free) == [0, 1, 2]
    assert pool.allocate(2).tolist() == [0, 1] and list(pool.free) == [2]
    assert pool.allocate(2).tolist() == [2, 3] and pool.capacity == 4 and pool.in_use == 4 and not len(pool.free)
    pool.release_all()
    assert list(pool.free) == [0, 1, 2, 3] and pool.in_use == 0 and pool.allocate(1).tolist() == [0]
    assert occurrence_rank(np.array([3, 1, 3, 3])).tolist() == [0, 0, 1, 2]
    assert occurrence_rank(np.array([2, 2, 5])).tolist() == [0, 1, 0]
    assert occurrence_rank(np.array([0, 4, 7])).tolist() == [0, 0, 0]
    assert occurrence_rank(np.array([], dtype=np.int64)).tolist() == []
    rows, offsets = ragged_ranges(np.array([2, 0, 3]))                 # _append's per-sequence token ranges
    assert rows.tolist() == [0, 0, 2, 2, 2] and offsets.tolist() == [0, 1, 0, 1, 2]
    assert [a.tolist() for a in ragged_ranges(np.array([0, 0]))] == [[], []]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned-memory path needs a GPU"))])
def test_device_indices_carry_every_array_in_one_copy(device):
    """Page bookkeeping goes to the GPU through one (asynchronous, pinned) copy per call: values and split exact,
    empty arrays included, every array 16-byte aligned whatever the lengths before it (the kernels given them
    compile once, not once per alignment), and a buffer of the ring is reused safely after it comes round again."""
    to_device = DeviceIndices(device)
    for turn in range(2 * DeviceIndices.RING + 1):
        arrays = [np.arange(turn, turn + 5), np.zeros(0, dtype=np.int64), [7 + turn, 3], np.full(300 * (turn % 2), turn)]
        got = to_device(*arrays)
        assert [t.device.type for t in got] == [device] * 4
        assert [t.tolist() for t in got] == [np.asarray(a, dtype=np.int64).tolist() for a in arrays]
        assert all(t.data_ptr() % 16 == 0 for t in got), [t.data_ptr() % 16 for t in got]


def test_device_indices_copy_once_for_the_layers_of_a_cache():
    """The layers of a cache share one DeviceIndices: at a page boundary they ask for the same rows, page ids and
    columns, and the copy made for the first layer serves the others; different arrays (or the caller's array
    changed in place) get a copy of their own."""
    to_device = DeviceIndices("cpu")
    first = to_device(np.arange(3), np.array([5, 6]))
    assert all(a is b for a, b in zip(first, to_device(np.arange(3), np.array([5, 6]))))
    other = to_device(np.arange(3), np.array([5, 7]))
    assert other[1].tolist() == [5, 7] and other[1] is not first[1]
    rows = np.arange(4)
    to_device(rows)
    rows[0] = 9
    assert to_device(rows)[0].tolist() == [9, 1, 2, 3]
    model = tiny_model(layers=3)
    cache = make_cache(model, "kitty")
    feed(model, torch.randint(3, 256, (2, 300), generator=torch.Generator().manual_seed(0)), cache, prefix=250)
    assert len({id(layer.to_device) for layer in cache.layers}) == 1


def test_a_further_chunk_copies_its_indices_once_for_all_layers(monkeypatch):
    """A chat's next turn on a ragged batch: every layer asks for the same host indices (dense rows, buffers, new
    pages, lengths), so a 3-layer cache copies exactly what a 1-layer cache copies, all in the first layer (each
    copy is a chance to wait for the GPU)."""
    copies, real = [], DeviceIndices._copy
    monkeypatch.setattr(DeviceIndices, "_copy", lambda self, *args: copies.append(args[2]) or real(self, *args))
    counted = []
    for layers in (1, 3):
        model = tiny_model(heads=4, kv_heads=2, layers=layers)
        ids = torch.randint(3, 256, (3, 300), generator=torch.Generator().manual_seed(15)).to(DEVICE)
        mask = torch.ones_like(ids)
        mask[1, :40] = 0
        cache = make_cache(model, "kitty-pro", sink=8, page_size=32, local_window=32)
        with torch.no_grad():
            model(input_ids=ids[:, :250], attention_mask=mask[:, :250], past_key_values=cache, use_cache=True)
            copies.clear()
            model(input_ids=ids[:, 250:], attention_mask=mask, past_key_values=cache, use_cache=True)
        counted.append(list(copies))
    assert counted[0] == counted[1] and len(counted[0]) <= DeviceIndices.RECENT


def test_memory_matches_the_layout_at_4096_tokens():
    """kitty at 4,096 tokens: the bytes used are what the layout implies (2 + 2 alpha bits per key element, 2 per
    value element, FP16 metadata, a page-table entry per page, sink / Q-buffer / window at 16 bits even for a
    float32 model), the same as backend.memory's arithmetic; what is reserved is at least that."""
    heads, dim, layers = 3, 64, 2                      # the default model's attention shape, fewer layers
    model = tiny_model(heads=9, kv_heads=heads, head_dim=dim, layers=layers, dtype=torch.float32)
    ids = torch.randint(3, 256, (1, 4096), generator=torch.Generator().manual_seed(4))
    cache = make_cache(model, "kitty")
    feed(model, ids, cache, prefix=4000)
    stats = cache.stats()
    assert stats.tokens == [4096]
    s, g, r, nb = 32, 128, 128, 8
    kp, vp = (4096 - s) // g, (4096 - s - r) // g
    per_layer = (
        2 * s * heads * dim * 2                                          # sink, keys and values, 16 bits
        + (4096 - s - kp * g) * heads * dim * 2                          # key Q-buffer
        + (4096 - s - vp * g) * heads * dim * 2                          # value Q-buffer + window
        + kp * (heads * (g * dim * 2 // 8 + g * nb * 2 // 8 + nb + dim * (2 + 2)) + 4)   # key planes, ids, scale, zero
        + vp * (heads * (g * dim * 2 // 8 + g * (2 + 2)) + 4))                         # value plane, scale, zero
    assert stats.bytes_used == layers * per_layer
    assert stats.bytes_used == memory.sequence_bytes(method_config("kitty"), model.config, 4096)
    assert stats.bytes_reserved >= stats.bytes_used
    assert stats.key_pages == layers * kp and stats.value_pages == layers * vp
    assert stats.fp16_bytes == layers * 2 * 4096 * heads * dim * 2 == memory.fp16_sequence_bytes(model.config, 4096)
    assert stats.kv_ratio == pytest.approx(stats.bytes_used / stats.fp16_bytes) and 0.15 < stats.kv_ratio < 0.2
    masks = stats.layers[0].boost_masks[0]
    assert masks.shape == (kp, heads, dim) and masks.sum(-1).eq(nb).all()
    assert stats.layers[0].magnitudes[0].shape == (kp, heads, dim)


@pytest.mark.parametrize("flush", ["torch", "fused"])
def test_magnitudes_not_recorded_take_no_storage(flush):
    """record_magnitudes=False (the benchmark's setting): the pool keeps no magnitude storage (a diagnostic, 2 of
    ~80 KB per page pair at Qwen3-8B's shape), stats() says NaN, and the pages are the same as when recorded."""
    model = tiny_model(heads=4, kv_heads=2, head_dim=64, layers=1)
    ids = torch.randint(3, 256, (2, 120), generator=torch.Generator().manual_seed(5))
    caches = [make_cache(model, "kitty-pro", record_magnitudes=recorded, flush=flush, sink=8, page_size=32,
                         local_window=32) for recorded in (True, False)]
    for cache in caches:
        feed(model, ids, cache, prefix=50)
    recorded, bare = (cache.layers[0] for cache in caches)
    assert bare.key_pool.tensors["magnitude"].numel() == 0 < recorded.key_pool.tensors["magnitude"].numel()
    for name in ("low", "high", "ch", "scale", "zero"):
        assert torch.equal(bare.key_pool.tensors[name], recorded.key_pool.tensors[name]), name
    (mask, magnitude), (mask_recorded, _) = bare.boost_record(1), recorded.boost_record(1)
    assert torch.equal(mask, mask_recorded) and magnitude.shape == mask.shape and magnitude.isnan().all()


@pytest.mark.parametrize("method", ["fp16", "kivi-k2v2", "kivi-k4v2*", "kitty-pro", "custom"])
def test_used_bytes_equal_the_projection_at_every_length(method):
    """Step by step through sink, pages and window, on a ragged batch: each sequence's used bytes are
    backend.memory's arithmetic for its length; the fp16 preset stays at exactly 1.00 of FP16."""
    cfg = method_config(method, **({"k_bits": 2, "v_bits": 4, "sink": 5, "page_size": 16, "local_window": 8,
                                    "alpha": 0.25} if method == "custom" else {}))
    model = tiny_model(heads=4, kv_heads=2, layers=1)
    ids = torch.randint(3, 256, (2, 170), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0                                   # left padding: sequence 1 holds 37 tokens fewer
    cache = make_cache(model, cfg)

    def check(cache):
        stats = cache.stats()
        expected = sum(memory.sequence_bytes(cfg, model.config, n) for n in stats.tokens)
        assert stats.bytes_used == expected, (stats.tokens, stats.bytes_used, expected)
        if method == "fp16":
            assert stats.kv_ratio == 1.0
    feed(model, ids, cache, prefix=20, mask=mask, on_step=check)


@pytest.mark.parametrize("method,flush_spread", [("kivi-k2v2", 1), ("kitty-pro", 1), ("kivi-k4v2*", 2),
                                                 ("custom", 3)])
def test_reserved_bytes_equal_the_arithmetic_the_benchmark_plans_with(method, flush_spread):
    """A cache that reserves room for 300 tokens per sequence (as `bench generate` makes them) allocates, at every
    step before and while it fills, exactly backend.memory's reserved bytes for 300 tokens per sequence: what the
    benchmark's batch planning assumes (the used bytes are less: unfilled buffers and pages)."""
    cfg = method_config(method, **({"k_bits": 2, "v_bits": 4, "sink": 5, "page_size": 16, "local_window": 8,
                                    "alpha": 0.25} if method == "custom" else {}))
    model = tiny_model(heads=4, kv_heads=2, layers=2)
    ids = torch.randint(3, 256, (2, 170), generator=torch.Generator().manual_seed(13))
    cache = make_cache(model, cfg, reserve_tokens=300, flush_spread=flush_spread)
    expected = 2 * memory.sequence_bytes(cfg, model.config, 300, reserved=True, flush_spread=flush_spread)

    def check(cache):
        stats = cache.stats()
        assert stats.bytes_reserved == expected > stats.bytes_used, (stats.bytes_reserved, expected)
    feed(model, ids, cache, prefix=20, on_step=check)


def test_sliding_window_layers_stay_full_precision_and_all_sliding_is_refused():
    hybrid = tiny_model("qwen2", heads=4, kv_heads=2, layers=2, use_sliding_window=True, sliding_window=64,
                        max_window_layers=1)
    kinds = hybrid.config.layer_types
    assert "sliding_attention" in kinds and "full_attention" in kinds
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    cache = make_cache(hybrid, "kitty")
    hybrid.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5,
                    do_sample=False, pad_token_id=0)
    layer_kinds = [layer.kind for layer in cache.stats().layers]
    assert sorted(layer_kinds) == ["fp16-sliding", "kitty"] and cache.stats().summary()["fp16_layers"] == 1
    sliding = tiny_model("mistral", heads=4, kv_heads=2, sliding_window=64)
    with pytest.raises(ValueError, match="sliding-window"):
        make_cache(sliding, "kitty")


def test_beam_search_reorders_the_cache():
    model = tiny_model(heads=4, kv_heads=2)
    ids = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    dyn = model.generate(ids, past_key_values=Fp16DynamicCache(model.config), **kwargs)
    ours = model.generate(ids, past_key_values=make_cache(model, "custom", k_bits=16, v_bits=16), **kwargs)
    assert torch.equal(dyn, ours)
    assert model.generate(ids, past_key_values=make_cache(model, "kitty"), **kwargs).shape == dyn.shape


def test_a_forward_reads_its_prompt_mask_once_for_all_layers(monkeypatch):
    """Reading a chunk's real tokens from its mask waits for the GPU, so the layers of a cache share one read per
    forward (the same mask tensor), and the next forward's new mask is read again."""
    model = tiny_model(heads=4, kv_heads=2, layers=3)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    reads, real = [], backend.cache.prompt_lengths
    monkeypatch.setattr(backend.cache, "prompt_lengths", lambda *args: reads.append(args[1]) or real(*args))
    cache = make_cache(model, "kitty")
    with torch.no_grad():
        model(input_ids=ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, 30:], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert reads == [30, 10]
    assert [layer.lengths.tolist() for layer in cache.layers] == [[40, 33]] * 3


def test_right_padding_is_refused_with_a_clear_error():
    model = tiny_model()
    ids = torch.randint(3, 256, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with pytest.raises(ValueError, match="left padding"):
        feed(model, ids, make_cache(model, "kitty"), prefix=20, mask=mask)


def test_dequantized_pages_track_the_keys():
    """Stats and pages agree: dequantizing a stored page gives back its tokens within the quantization step."""
    model = tiny_model()
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(6))
    reference, cache = DynamicCache(config=model.config), make_cache(model, "kitty-pro", page_size=64)
    feed(model, ids, reference, prefix=200)
    feed(model, ids, cache, prefix=200)
    layer = cache.layers[0]
    pool = layer.key_pool.tensors
    pid = layer.key_table.pages_of(0)[0]
    k = dequantize_keys_ref(*(pool[n][pid:pid + 1] for n in ("low", "high", "ch", "scale", "zero")),
                            torch.float32)[0]
    x = reference.layers[0].keys[0, :, 32:96]
    assert ((k - x).abs() <= pool["scale"][pid].float().unsqueeze(1) / 2 + 1e-3).all()


@pytest.mark.parametrize("method", ["kitty-pro", "kivi-k4v4", "fp16"])
@pytest.mark.parametrize("use_triton", [False, True])
def test_a_further_prompt_chunk_attends_over_the_whole_cache(method, use_triton):
    """A chunk of new tokens on a filled, ragged cache (the next turn of a chat): the batched path (pages
    dequantized in batched launches, lower-right causal SDPA) equals causal attention over each sequence's own
    tokens."""
    gen = torch.Generator().manual_seed(13)
    lengths, n, heads, group, dim = np.array([300, 161]), 7, 2, 3, 64
    k, v = (torch.randn(2, heads, 300, dim, generator=gen).to(DEVICE) for _ in range(2))
    layer = KittyLayer(method_config(method, page_size=64, local_window=32), use_triton=use_triton)
    layer.lazy_initialization(k, v)
    layer._append(k, v, lengths)
    q = torch.randn(2, heads * group, n, dim, generator=gen).to(DEVICE)
    new_k, new_v = (torch.randn(2, heads, n, dim, generator=gen).half().float().to(DEVICE) for _ in range(2))
    out = layer._attend_chunk(q, new_k, new_v, 0.125)                   # (B, n, HQ, D)
    paged = layer.paged()
    for b in range(2):
        keys, values = kernels.decode_attention.gather_kv(paged, b, torch.float32)
        keys = torch.cat([keys, new_k[b]], 1).repeat_interleave(group, 0)
        values = torch.cat([values, new_v[b]], 1).repeat_interleave(group, 0)
        causal = torch.ones(n, lengths[b] + n, dtype=torch.bool, device=DEVICE).tril(int(lengths[b]))
        want = torch.nn.functional.scaled_dot_product_attention(q[b], keys, values, attn_mask=causal, scale=0.125)
        torch.testing.assert_close(out[b].transpose(0, 1), want, atol=2e-5, rtol=2e-5)


class _Attention:
    """What sdpa_attention_forward reads from an attention module."""
    is_causal = True

    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def _attend(layer: KittyLayer, q, k, v, mask=None):
    """One attention call of `layer` on given (post-RoPE) queries, keys and values, as the model would make it."""
    tagged, v = layer.update(k, v)
    return layer.attend(_Attention(q.shape[1] // k.shape[1]), q, tagged, v, mask, k.shape[-1] ** -0.5)


def _query_prompt(batch=1, heads=2, group=2, length=8 + 3 * 32 + 5, dim=64, seed=5):
    """Queries, keys, values of a prompt whose queries from the third page on read channel 11 a hundred times
    more strongly: only choices that see those queries favour channel 11."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, heads, length, dim, generator=gen).half().float() for _ in range(2))
    q = torch.randn(batch, heads * group, length, dim, generator=gen)
    q[:, :, 8 + 2 * 32:, 11] *= 100
    return q, k, v


def _pages(layer: KittyLayer, b: int = 0) -> torch.Tensor:
    return layer.key_pool.tensors["ch"][layer.key_table.pages_of(b)]


def test_query_aware_pages_use_only_the_queries_already_seen():
    """Each page of a prompt is chosen with the queries of its own and earlier tokens: later queries cannot change
    it (a decode run would not have seen them yet). The strong late queries move the choice once seen, so the test
    would catch an estimate that looked ahead."""
    cfg = method_config("kitty", selection="query", sink=8, page_size=32, local_window=32)
    q, k, v = _query_prompt()
    layer = KittyLayer(cfg)
    _attend(layer, q, k, v)
    chosen = _pages(layer)
    assert chosen.shape == (3, 2, 8)
    group_energy = lambda end: q[0, :, :end].square().sum(1).reshape(2, 2, 64).sum(1).double()  # noqa: E731
    for p in range(3):
        end = 8 + (p + 1) * 32
        page = k[:, :, end - 32:end]
        assert torch.equal(chosen[p], choose_boost(page, 8, "query", query_energy=group_energy(end)[None])[0][0])
        if p < 2:                                   # with the later, loud queries the choice would differ
            looked_ahead = choose_boost(page, 8, "query", query_energy=group_energy(q.shape[2])[None])[0][0]
            assert not torch.equal(chosen[p], looked_ahead)
    assert boost_mask(chosen[2], 64)[:, 11].all() and not boost_mask(chosen[:2], 64)[..., 11].all()


@pytest.mark.parametrize("flush_spread", [1, 3])
def test_query_aware_pages_are_the_same_token_by_token_batched_and_left_padded(flush_spread):
    """The same pages whether the prompt comes at once or one token at a time, in a batch of three whose buffers
    fill together and are quantized over several steps (flush_spread = 3: a waiting page still uses the queries up
    to its last token), or left-padded beside a longer prompt (padding adds no query)."""
    cfg = method_config("kitty", selection="query", sink=8, page_size=32, local_window=32)
    q, k, v = _query_prompt(batch=3)
    alone = []
    for b in range(3):
        layer = KittyLayer(cfg)
        _attend(layer, q[b:b + 1], k[b:b + 1], v[b:b + 1])
        alone.append(_pages(layer))
    stepped = KittyLayer(cfg, flush_spread=flush_spread)
    _attend(stepped, q[:, :, :8], k[:, :, :8], v[:, :, :8])
    for t in range(8, q.shape[2]):
        _attend(stepped, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    for b in range(3):
        assert torch.equal(_pages(stepped, b), alone[b])
    # sequence 1 shortened by 20 tokens and left-padded beside sequence 0
    n = q.shape[2]
    q2, k2, v2 = (torch.cat([t[:1], torch.cat([torch.zeros_like(t[1:2, :, :20]), t[1:2, :, :n - 20]], 2)])
                  for t in (q, k, v))
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, :20] = False
    mask = (torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    padded = KittyLayer(cfg)
    _attend(padded, q2, k2, v2, mask)
    short = KittyLayer(cfg)
    _attend(short, q[1:2, :, :n - 20], k[1:2, :, :n - 20], v[1:2, :, :n - 20])
    assert torch.equal(_pages(padded, 0), alone[0]) and torch.equal(_pages(padded, 1), _pages(short))


def test_query_aware_presets_generate_with_the_same_memory_as_kitty():
    """kitty-q / kitty-pro-q are kitty / kitty-pro with query-aware channels: same bytes, other channels."""
    model = tiny_model(heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for plain, aware in (("kitty", "kitty-q"), ("kitty-pro", "kitty-pro-q")):
        assert method_config(aware).selection == "query"
        assert dataclasses.replace(method_config(aware), name=plain, selection="magnitude") == method_config(plain)
        caches = [make_cache(model, name) for name in (plain, aware)]
        for cache in caches:
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=30,
                           do_sample=False, pad_token_id=0)
        stats = [cache.stats() for cache in caches]
        assert stats[0].bytes_used == stats[1].bytes_used and stats[1].key_pages == 2          # a page per layer
        assert not all(torch.equal(a, b) for a, b in zip(stats[0].layers[0].boost_masks, stats[1].layers[0].boost_masks))


def test_teacher_forcing_in_chunks_between_page_boundaries_equals_one_token_a_step(monkeypatch):
    """Chunks that end where pages form give every token the cache it would see when decoded: the same
    log-probabilities as one decode step per token (up to float32 rounding), for keys-only, values and
    query-aware pages; the boundaries are the lengths where the paper's schedule quantizes."""
    from backend import analysis
    model = tiny_model(heads=4, kv_heads=2, head_dim=64)
    ids = torch.randint(3, 256, (1, 230), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for name in ("kivi-k2v2", "kivi-k4v2*", "kitty-q"):
        config = method_config(name, sink=8, page_size=32, local_window=32)
        cuts = analysis.page_lengths(make_cache(model, config), 5, 229)
        assert cuts == sorted({*range(8 + 32, 229, 32), *range(8 + 32 + 32, 229, 32)})
        chunked = analysis.teacher_forced_logprobs(model, ids, make_cache(model, config), prefix=5)
        with monkeypatch.context() as patch:
            patch.setattr(analysis, "page_lengths", lambda *args: None)
            stepped = analysis.teacher_forced_logprobs(model, ids, make_cache(model, config), prefix=5)
        assert chunked.shape == stepped.shape == (225, 256)
        if DEVICE == "cpu":
            # float32 references on both paths: equal up to rounding, which differs by CPU (on the 2-core Xeon of
            # 2026-12-02, 17 of 57,600 log-probabilities 1.0-1.4e-4 apart, where earlier machines stayed under 1e-4)
            torch.testing.assert_close(chunked, stepped, atol=5e-4, rtol=0)
        else:
            # On a GPU a decode step runs the Triton decode kernel (16-bit operands in its dot products) and a
            # chunk runs float32 SDPA over dequantized pages: they differ by the kernel's own precision, measured on
            # the H200 at a mean of up to 3e-4 and a maximum of 4e-3 (kivi-k4v2*); a misplaced chunk moves whole
            # positions by far more
            diff = (chunked - stepped).abs()
            assert diff.mean() < 1e-3 and diff.max() < 2e-2, (name, diff.mean().item(), diff.max().item())
    assert analysis.page_lengths(make_cache(model, "kitty", flush_spread=2), 5, 229) is None


# ---------------------------------------------------------------------------------------------- chunked prefill
def _sdpa_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Record (batch, queries, keys) of every SDPA call given a lower-right causal bias (torch dispatches those to
    CausalBias._dispatch: flash attention on CUDA) rather than a mask tensor."""
    from torch.nn.attention.bias import CausalBias
    calls, dispatch = [], CausalBias._dispatch

    def spy(query, key, value, attn_mask, *args, **kwargs):
        calls.append((query.shape[0], attn_mask.seq_len_q, attn_mask.seq_len_kv))
        return dispatch(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(spy))
    return calls


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("lengths,counts,calls", [
    ([300, 300, 300], [7, 7, 7], [(3, 7, 307)]),                         # equal and all real: one call, no mask
    ([300, 161, 161, 0, 0], [7, 7, 3, 7, 0], [(1, 7, 307), (1, 7, 168), (1, 3, 164), (1, 7, 7)]),   # ragged
])
def test_a_chunk_attends_lower_right_with_no_mask_for_equal_and_ragged_lengths(monkeypatch, group, lengths, counts,
                                                                                calls):
    """A chunk of n tokens whose last counts[b] are real (left padding before them, as chunked prefill of a ragged
    batch gives) on a cache holding lengths[b] tokens: each real query attends causally over its sequence's cache as
    decode reads it (pages dequantized) and its chunk's real tokens; padding rows are zeros, never NaN. Sequences
    with the same length and count share one SDPA call with a lower-right causal bias, no mask tensor. Pages are
    dequantized three at a time here (slices across sequences)."""
    gen = torch.Generator().manual_seed(14)
    lengths, counts, n, heads, dim = np.array(lengths), np.array(counts), 7, 2, 64
    monkeypatch.setattr(backend.cache, "DEQUANT_ELEMENTS", 3 * heads * 64 * dim)
    bsz = len(lengths)
    k, v = (torch.randn(bsz, heads, 300, dim, generator=gen).to(DEVICE) for _ in range(2))
    layer = KittyLayer(method_config("kitty-pro", page_size=64, local_window=32), use_triton=False)
    layer.lazy_initialization(k, v)
    layer._append(k, v, lengths)
    q = torch.randn(bsz, heads * group, n, dim, generator=gen).to(DEVICE)
    new_k, new_v = (torch.randn(bsz, heads, n, dim, generator=gen).half().float().to(DEVICE) for _ in range(2))
    made = _sdpa_calls(monkeypatch)
    out = layer._attend_chunk(q, new_k, new_v, 0.125, counts)          # (B, n, HQ, D)
    assert made == calls
    paged = layer.paged()
    for b in range(bsz):
        pad = n - counts[b]
        assert out[b, :pad].eq(0).all()
        if not counts[b]:
            continue
        keys, values = kernels.decode_attention.gather_kv(paged, b, torch.float32)
        keys = torch.cat([keys, new_k[b, :, pad:]], 1).repeat_interleave(group, 0)
        values = torch.cat([values, new_v[b, :, pad:]], 1).repeat_interleave(group, 0)
        causal = torch.ones(counts[b], lengths[b] + counts[b], dtype=torch.bool, device=DEVICE).tril(int(lengths[b]))
        want = torch.nn.functional.scaled_dot_product_attention(q[b, :, pad:], keys, values, attn_mask=causal,
                                                                scale=0.125)
        torch.testing.assert_close(out[b, pad:].transpose(0, 1), want, atol=2e-5, rtol=2e-5)


def _ragged_prompts(pads: list[int], width: int, seed: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of `width` positions, pads[b] of them padding (token 0, mask 0)."""
    ids = torch.randint(3, 256, (len(pads), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]).long()
    return ids * mask, mask


def _greedy_alone(model, ids: torch.Tensor, cuts: list[int], cache, new_tokens: int) -> torch.Tensor:
    """One unpadded prompt (1, L) fed in chunks ending at `cuts` (then the rest), then greedy decoding: the logits of
    each generated token (new_tokens, V), as generate() computes them."""
    ids = ids.to(model.device)
    logits, start = [], 0
    with torch.no_grad():
        for end in [*cuts, ids.shape[1]]:
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(start, end, device=model.device)[None])
            start = end
        for i in range(new_tokens):
            logits.append(out.logits[0, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[start + i]], device=model.device))
    return torch.stack(logits)


@pytest.mark.parametrize("method", ["kitty-pro", "kivi-k2v2", "kitty-q"])
@pytest.mark.parametrize("chunk", [16, 13])
def test_chunked_prefill_of_a_ragged_batch_equals_each_prompt_alone(method, chunk):
    """generate(prefill_chunk_size=k) on a left-padded batch: every sequence gets the logits and greedy tokens of its
    prompt run alone in the same chunks (a chunk sees the earlier ones through the cache: pages dequantized). Padding
    reaches into the second chunk (21), fills the first two (33), or none (0); chunk 13 leaves a last chunk of one
    token (the decode path)."""
    model = tiny_model(heads=4, kv_heads=2, layers=2)
    config = method_config(method, sink=4, page_size=8, local_window=8)
    width, pads, new_tokens = 40, [0, 21, 5, 33], 6
    ids, mask = _ragged_prompts(pads, width)
    out = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), past_key_values=make_cache(model, config),
                         max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk,
                         output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, 1)
    assert logits.isfinite().all()
    for b, pad in enumerate(pads):
        cuts = [end - pad for end in range(chunk, width, chunk) if end > pad]
        want = _greedy_alone(model, ids[b:b + 1, pad:], cuts, make_cache(model, config), new_tokens)
        torch.testing.assert_close(logits[b], want, atol=1e-4, rtol=0)
        assert torch.equal(out.sequences[b, width:], want.argmax(-1))


@pytest.mark.parametrize("method", ["kitty", "kivi-k4v2*", "fp16"])
def test_chunked_prefill_stores_the_same_tokens_and_pages_as_one_pass(method):
    """The prompt of a ragged batch in chunks of 16 or at once: the same tokens, pages and used bytes (stats), and
    layer 0 (whose keys depend only on the embeddings) holds exactly each sequence's own tokens, pages bit for bit."""
    model = tiny_model(heads=4, kv_heads=2, layers=2)
    config = method_config(method, sink=4, page_size=8, local_window=8)
    width, pads = 60, [0, 23, 41]
    ids, mask = _ragged_prompts(pads, width, seed=16)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    kwargs = dict(attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    stats = []
    for chunk in (None, 16):
        # the tokens to find, computed in the same chunks: a GPU's matrix products round differently for other shapes
        reference = DynamicCache(config=model.config)
        model.generate(ids, past_key_values=reference, prefill_chunk_size=chunk, **kwargs)
        cache = make_cache(model, config)
        model.generate(ids, past_key_values=cache, prefill_chunk_size=chunk, **kwargs)
        stats.append(cache.stats().summary())
        stats[-1].pop("bytes_reserved")          # page tables grow (doubling) chunk by chunk: other capacities
        for b, pad in enumerate(pads):
            check_layer_content(cache.layers[0], reference.layers[0].keys[b, :, pad:],
                                reference.layers[0].values[b, :, pad:], b)
    assert stats[0] == stats[1] and stats[1]["tokens"] == [width - pad for pad in pads]
