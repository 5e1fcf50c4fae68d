"""The paper's Figure 2b on any layer: how much each key channel alone, stored at 2 bits, disturbs attention.

One FP16 pass over the text records every layer's post-RoPE queries and keys as the cache stores them (16 bits).
For channel c of a KV head, its keys are quantized page by page as the cache would (sink and the unfinished
buffer stay exact), everything else exact, and the error is the paper's metric: the mean squared difference of
the softmax attention weights over the causal (query, key) pairs, per query head of the group. Beside it, the two
rankings a cache can compute online: mean |k| (Kitty) and E[q_c^2] x the channel's mean squared 2-bit error
(query-aware), with Spearman's rank correlation to the measured error and the overlap of their top channels.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.dequantize import dequantize_keys_ref
from kernels.quantize import channel_error_ref, choose_boost, quantize_keys_ref

from ..cache import KittyLayer
from ..methods import PRESETS, CacheConfig
from .common import (QUICK_BASE, Progress, config_settings, layered_cache, record, sig, spearman, text_ids,
                     top_overlap)

SETTINGS = {"full": dict(tokens=1024, layers=None, stride=4, base=PRESETS["kitty"]),
            "quick": dict(tokens=96, layers=(0,), stride=1, base=QUICK_BASE)}
COLUMNS = ["layer", "Spearman: magnitude", "Spearman: query-aware", "top-k overlap: magnitude",
           "top-k overlap: query-aware"]
CHUNK = 16                                   # channels perturbed at once (memory: CHUNK x T x T floats)


class RecordingLayer(KittyLayer):
    """A full-precision layer that keeps the queries and keys it attends with (keys rounded to 16 bits, as
    stored)."""

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        self.recorded = (query.detach().float(), key.to(self.store_dtype).float(), scaling)
        return super().attend(module, query, key, value, attention_mask, scaling, **kwargs)


@torch.no_grad()
def record_attention(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per full-attention layer: (queries (HQ, T, D), keys (H, T, D), scaling) of one FP16 forward over
    input_ids (batch 1)."""
    layers = model.config.get_text_config().num_hidden_layers
    cache = layered_cache(model, [PRESETS["fp16"]] * layers, RecordingLayer)
    model(input_ids.to(model.device), past_key_values=cache, use_cache=True)
    return {i: (layer.recorded[0][0].cpu(), layer.recorded[1][0].cpu(), layer.recorded[2])
            for i, layer in enumerate(cache.layers) if isinstance(layer, RecordingLayer)}


def two_bit_delta(keys: torch.Tensor, config: CacheConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (H, T, D) -> (their error when every full page is stored at 2 bits (H, T, D), zero in the sink and the
    buffer; the pages (P, H, G, D))."""
    h, t, d = keys.shape
    s, g = config.sink, config.page_size
    pages = max(0, t - s) // g
    if not pages:
        raise ValueError(f"{t} tokens fill no {g}-token key page after the {s}-token sink")
    x = keys[:, s:s + pages * g].reshape(h, pages, g, d).transpose(0, 1).contiguous()
    ch, _ = choose_boost(x, 0)
    low, high, scale, zero = quantize_keys_ref(x, ch, 0)
    restored = dequantize_keys_ref(low, high, ch, scale, zero, dtype=torch.float32)
    delta = torch.zeros_like(keys)
    delta[:, s:s + pages * g] = (restored - x).transpose(0, 1).reshape(h, pages * g, d)
    return delta, x


def attention_mse(q: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, scaling: float,
                  stride: int = 1) -> torch.Tensor:
    """q (T, D), k and delta (T, D) -> (D,): mean over causal pairs of the squared change of the softmax weights
    when channel c alone of the keys moves by delta[:, c]; the queries of every `stride`-th position only (an
    unbiased sample of the rows: the cost falls by `stride`)."""
    t, d = k.shape
    positions = torch.arange(0, t, stride)
    q = q[positions]
    causal = positions[:, None] >= torch.arange(t)[None, :]
    scores = (q @ k.T * scaling).masked_fill(~causal, float("-inf"))
    weights = scores.softmax(-1)
    out = torch.empty(d)
    for start in range(0, d, CHUNK):
        c = torch.arange(start, min(d, start + CHUNK))
        moved = scores + scaling * q[:, c].T[:, :, None] * delta[:, c].T[:, None, :]    # (C, T, T)
        out[c] = (moved.softmax(-1) - weights).square().sum((1, 2)) / causal.sum()
    return out


def layer_channels(q: torch.Tensor, k: torch.Tensor, scaling: float, config: CacheConfig,
                   stride: int = 1) -> list[dict]:
    """Per KV head of one layer: the measured error per query head and channel, both rankings, and how well each
    ranking agrees with the error (Spearman; share of the top-NB channels found, NB = the config's budget)."""
    heads, dim = k.shape[0], k.shape[2]
    group = q.shape[0] // heads
    delta, pages = two_bit_delta(k, config)
    magnitude = pages.abs().mean((0, 2))                                             # (H, D) mean |k| over pages
    query_score = q.square().reshape(heads, group, -1, dim).mean((1, 2)) * channel_error_ref(pages).mean(0)
    budget = config.boosted_channels(dim)
    out = []
    for h in range(heads):
        mse = torch.stack([attention_mse(q[h * group + i], k[h], delta[h], scaling, stride) for i in range(group)])
        truth = mse.mean(0).numpy()
        out.append({"mse": [[sig(v, 3) for v in row] for row in mse.tolist()],
                    "magnitude": [sig(v, 3) for v in magnitude[h].tolist()],
                    "query_score": [sig(v, 3) for v in query_score[h].tolist()],
                    "rho_magnitude": spearman(truth, magnitude[h].numpy()),
                    "rho_query": spearman(truth, query_score[h].numpy()),
                    "top_magnitude": top_overlap(truth, magnitude[h].numpy(), budget),
                    "top_query": top_overlap(truth, query_score[h].numpy(), budget)})
    return out


def measure(model, input_ids: torch.Tensor, *, layers: Sequence[int] | None = None, stride: int = 1,
            base: CacheConfig = PRESETS["kitty"], progress: Progress | None = None) -> dict:
    recorded = record_attention(model, input_ids)
    chosen = list(recorded) if layers is None else [int(i) for i in layers]
    if not chosen or not all(i in recorded for i in chosen):
        raise ValueError(f"layers must be full-attention layers among {list(recorded)}, not {layers}")
    per_layer, rows = {}, []
    for n, i in enumerate(chosen):
        heads = layer_channels(*recorded[i], base, stride)
        per_layer[str(i)] = heads
        mean = lambda key: sig(float(np.mean([h[key] for h in heads])), 3)      # noqa: E731
        rows.append([i, mean("rho_magnitude"), mean("rho_query"), mean("top_magnitude"), mean("top_query")])
        if progress:
            progress((n + 1) / len(chosen), f"layer {i}: per-channel attention error")
    budget = base.boosted_channels(recorded[chosen[0]][1].shape[2])
    settings = {"text tokens": int(input_ids.shape[1]), "layers": chosen, "top-k (the base's boost budget)": budget,
                "metric": "mean squared change of the softmax attention weights over causal pairs",
                "query positions": f"every {stride}",
                "base": config_settings(base)}
    return record("channels", "Per-channel attention error at 2 bits (paper Figure 2b) and the two rankings",
                  model, settings, COLUMNS, rows, summarize, layers=per_layer)


def summarize(result: dict) -> str:
    rows, budget = result["rows"], result["settings"]["top-k (the base's boost budget)"]
    rho_m, rho_q = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    top_m, top_q = np.array([r[3] for r in rows]), np.array([r[4] for r in rows])
    better = int((rho_q > rho_m).sum())
    return (f"Over {len(rows)} layer(s), the query-aware score ranks channels closer to their measured attention "
            f"error than mean |k| in {better}: mean Spearman {rho_q.mean():.2f} vs {rho_m.mean():.2f}; of the "
            f"{budget} channels that matter most, it finds {100 * top_q.mean():.0f}% against magnitude's "
            f"{100 * top_m.mean():.0f}%.")


def run(model, tokenizer, *, tokens: int, layers: Sequence[int] | None = None, stride: int = 1,
        base: CacheConfig = PRESETS["kitty"], progress: Progress | None = None) -> dict:
    return measure(model, text_ids(tokenizer, tokens, base), layers=layers, stride=stride, base=base,
                   progress=progress)
