"""CUDA-graph decoding (backend/graphs.py): a replayed step must do exactly what the eager step would.

On a CPU: the facts a replay relies on, checked against real eager steps (which steps are ordinary, what an
ordinary step changes on the host, that it moves no tensor, that quantizing after the forward changes nothing).
On a GPU: graphed generation gives the same tokens and logits as eager generation, across page boundaries, for a
ragged left-padded batch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, tiny_model

from backend import make_cache
from backend.cache import KittyLayer
from backend.graphs import CudaGraphDecoding

SMALL_PAGES = dict(sink=8, page_size=32, local_window=32)      # page boundaries every 32 steps


def host_state(layer):
    return dict(seen=layer.seen, lengths=layer.lengths.copy(), key_pages=layer.key_table.counts.copy(),
                value_pages=layer.value_table.counts.copy(), in_use=(layer.key_pool.in_use, layer.value_pool.in_use),
                pointers=layer.storage_pointers(),
                at_fill=layer.q_energy_at_fill.clone() if layer.query_aware else None)


@pytest.mark.parametrize("method,flush_spread", [("kitty-pro", 1), ("kitty-q", 1), ("kivi-k2v2", 2)])
def test_ordinary_steps_are_predicted_and_change_only_the_lengths(method, flush_spread):
    model = tiny_model("qwen3", heads=4, kv_heads=2, head_dim=64, device="cpu")
    cache = make_cache(model, method, reserve_tokens=200, flush_spread=flush_spread, **SMALL_PAGES)
    ids = torch.randint(3, 256, (3, 110), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                                            # ragged: left padding
    mask[2, :40] = 0
    kinds = []
    with torch.no_grad():
        model(ids[:, :45], attention_mask=mask[:, :45], past_key_values=cache, use_cache=True)
        for i in range(45, ids.shape[1]):
            layers = cache.layers
            ordinary = layers[0].next_decode_is_ordinary()
            assert all(layer.next_decode_is_ordinary() == ordinary for layer in layers)
            before = [host_state(layer) for layer in layers]
            model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], past_key_values=cache, use_cache=True)
            kinds.append(ordinary)
            for layer, old in zip(layers, before):
                new = host_state(layer)
                # reserve_tokens covers the run: no step moves a tensor, page-boundary steps neither (one capture)
                assert new["pointers"] == old["pointers"], i
                if not ordinary:
                    continue
                assert new["seen"] == old["seen"] + 1 and np.array_equal(new["lengths"], old["lengths"] + 1)
                for name in ("key_pages", "value_pages"):
                    assert np.array_equal(new[name], old[name]), (i, name)
                assert new["in_use"] == old["in_use"], i
                if layer.query_aware:
                    assert torch.equal(new["at_fill"], old["at_fill"])
    # both kinds occur; the page-boundary steps are few (one or flush_spread per 32 tokens, per length)
    assert sum(kinds) > 0.7 * len(kinds) and not all(kinds)


def test_replayed_step_host_effect_is_an_ordinary_steps():
    model = tiny_model("llama", heads=4, kv_heads=1, head_dim=64, device="cpu")
    cache = make_cache(model, "kitty", **SMALL_PAGES)
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :50], past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.graphable() and layer.next_decode_is_ordinary()
    seen, lengths = layer.seen, layer.lengths.copy()
    layer.replayed_decode_step()
    assert layer.seen == seen + 1 and np.array_equal(layer.lengths, lengths + 1)
    assert not make_cache(model, "fp16").layers[0].graphable()    # not initialized, and 16-bit sides never


@pytest.mark.parametrize("method", ["kitty-pro", "kitty-q"])
def test_quantizing_after_the_forward_equals_quantizing_inside_it(method, monkeypatch):
    """What a replayed page-boundary step does: the forward (insert, attend) for every layer, then each layer's
    full buffers become pages. Same logits and the same pages as the eager step, which quantizes layer by layer."""
    model = tiny_model("qwen3", heads=4, kv_heads=2, head_dim=64, device="cpu")
    ids = torch.randint(3, 256, (2, 110), generator=torch.Generator().manual_seed(2))
    eager, deferred = (make_cache(model, method, **SMALL_PAGES) for _ in range(2))
    quantize = KittyLayer._quantize_full_buffers
    boundaries = 0
    with torch.no_grad():
        for cache in (eager, deferred):
            model(ids[:, :20], past_key_values=cache, use_cache=True)
        for i in range(20, ids.shape[1]):
            want = model(ids[:, i:i + 1], past_key_values=eager, use_cache=True).logits
            ordinary = deferred.layers[0].next_decode_is_ordinary()
            monkeypatch.setattr(KittyLayer, "_quantize_full_buffers", lambda self: None)
            got = model(ids[:, i:i + 1], past_key_values=deferred, use_cache=True).logits
            monkeypatch.setattr(KittyLayer, "_quantize_full_buffers", quantize)
            if not ordinary:
                boundaries += 1
                for layer in deferred.layers:
                    layer._quantize_full_buffers()
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert boundaries >= 3
    for a, b in zip(eager.layers, deferred.layers):                  # the same pages and buffers
        assert torch.equal(a.k_fp, b.k_fp) and torch.equal(a.v_fp, b.v_fp)
        for table, pool in (("key_table", "key_pool"), ("value_table", "value_pool")):
            for seq in range(a.batch):
                ids_a, ids_b = getattr(a, table).pages_of(seq), getattr(b, table).pages_of(seq)
                assert len(ids_a) == len(ids_b)
                for name, tensor in getattr(a, pool).tensors.items():
                    assert torch.equal(tensor[ids_a], getattr(b, pool).tensors[name][ids_b]), (table, seq, name)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["kitty-pro", "kitty-q", "kivi-k2v2"])
def test_graphed_generation_equals_eager_generation(method):
    model = tiny_model("qwen3", heads=8, kv_heads=2, head_dim=128, layers=3, dtype=torch.bfloat16)
    ids = torch.randint(3, 256, (3, 70), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :33] = 0
    runs = []
    for graphed in (False, True):
        cache = make_cache(model, method, reserve_tokens=300, **SMALL_PAGES)
        kwargs = dict(attention_mask=mask, past_key_values=cache, max_new_tokens=150, min_new_tokens=150,
                      do_sample=False, output_scores=True, return_dict_in_generate=True, disable_compile=True)
        if graphed:
            with CudaGraphDecoding(model) as graphs:
                out = model.generate(ids, **kwargs)
            # 149 decode steps: one eager (two or three when page boundaries come first: a capture waits for an
            # ordinary step), one captured, every other one replayed, page-boundary steps too (reserve_tokens sized
            # the pools and tables: nothing the graph reads ever moves)
            assert graphs.disabled is None and graphs.captures == 1 and 145 <= graphs.replays <= 147, \
                (graphs.captures, graphs.replays, graphs.disabled)
        else:
            out = model.generate(ids, **kwargs)
        runs.append((out.sequences, torch.stack(out.scores, 1)))
    (eager_ids, eager_scores), (graph_ids, graph_scores) = runs
    assert torch.equal(eager_ids, graph_ids)
    torch.testing.assert_close(graph_scores, eager_scores, atol=1e-3, rtol=0)
    assert "forward" not in model.__dict__                     # the context manager put the model back
