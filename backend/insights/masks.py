"""Mask dynamics: how much the boosted channels of a page differ from the previous page's, per layer, and what a
mask chosen on each sequence's first key page and then frozen (a static mask, as calibration-based schemes use)
costs against Kitty's choice per page. Both run in the product cache on the same text (teacher-forced KL)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from .. import make_cache
from ..cache import KittyLayer
from ..methods import PRESETS, CacheConfig
from .common import (QUICK_BASE, Progress, config_settings, forced_quality, head_dim_of, layered_cache, record,
                     sig, text_ids)

SETTINGS = {"full": dict(tokens=1024, selections=("magnitude", "query"), base=PRESETS["kitty"]),
            "quick": dict(tokens=96, selections=("magnitude", "query"), base=QUICK_BASE)}
COLUMNS = ["selection", "mask", "KL vs FP16 (nats/token)", "perplexity", "top-1 agreement with FP16",
           "Jaccard with the previous page", "Jaccard with the first page"]
MODES = ("per page", "first page")


class FirstPageMaskLayer(KittyLayer):
    """Chooses each sequence's boosted channels on its first key page (by the layer's selection) and keeps them
    for all its later pages."""

    def _choose_boost(self, key_x, rows, cols, energy):
        ch, magnitude = super()._choose_boost(key_x, rows, cols, energy)
        first = self.__dict__.setdefault("first_ch", {})
        for i, (row, col) in enumerate(zip(rows.tolist(), cols.tolist())):
            if col == 0:
                first[row] = ch[i]
        return torch.stack([first[row] for row in rows.tolist()]), magnitude


def jaccard(masks: torch.Tensor) -> tuple[float, float]:
    """masks (pages, H, D) bool -> mean Jaccard index of each page's boosted set with the previous page's, and
    with the first page's (over heads and pages; NaN with fewer than two pages)."""
    if masks.shape[0] < 2:
        return float("nan"), float("nan")

    def mean_index(a: torch.Tensor, b: torch.Tensor) -> float:
        union = (a | b).sum(-1).float()
        return ((a & b).sum(-1).float() / union.clamp_min(1)).mean().item()

    later = masks[1:]
    return mean_index(later, masks[:-1]), mean_index(later, masks[:1].expand_as(later))


def random_jaccard(k: int, d: int) -> float:
    """Expected Jaccard index of two independent random k-channel sets out of d (hypergeometric overlap)."""
    if k == 0:
        return float("nan")
    total = math.comb(d, k)
    return sum(math.comb(k, i) * math.comb(d - k, k - i) / total * i / (2 * k - i) for i in range(k + 1))


def measure(model, input_ids: torch.Tensor, *, selections: Sequence[str] = ("magnitude", "query"),
            base: CacheConfig = PRESETS["kitty"], progress: Progress | None = None) -> dict:
    layers = model.config.get_text_config().num_hidden_layers
    configs = {selection: replace(base, name=selection, selection=selection) for selection in selections}
    caches = {}
    for selection, config in configs.items():
        caches[f"{selection}/per page"] = partial(make_cache, model, config)
        caches[f"{selection}/first page"] = partial(layered_cache, model, [config] * layers, FirstPageMaskLayer)
    quality, _ = forced_quality(model, input_ids, caches, progress=progress)
    rows, per_layer = [], {}
    for selection in selections:
        for mode in MODES:
            m = quality[f"{selection}/{mode}"]
            kitty = [layer for layer in m["stats"].layers if layer.kind == "kitty"]
            pairs = [jaccard(layer.boost_masks[0]) for layer in kitty]
            if mode == "per page":
                per_layer[selection] = {"layers": [layer.index for layer in kitty],
                                        "previous": [sig(p, 3) for p, _ in pairs],
                                        "first": [sig(f, 3) for _, f in pairs]}
            rows.append([selection, mode, sig(m["kl"]), sig(m["perplexity"]), sig(m["agreement"]),
                         sig(float(np.nanmean([p for p, _ in pairs])), 3),
                         sig(float(np.nanmean([f for _, f in pairs])), 3)])
    head_dim = head_dim_of(model)
    budget = base.boosted_channels(head_dim)
    chance = random_jaccard(budget, head_dim)
    settings = {"text tokens": int(input_ids.shape[1]), "key pages": (input_ids.shape[1] - base.sink) // base.page_size,
                "base": config_settings(base)}
    return record("masks", "Mask dynamics: how much the boosted set changes from page to page", model, settings,
                  COLUMNS, rows, summarize, jaccard=per_layer, random_jaccard=sig(chance, 3))


def summarize(result: dict) -> str:
    rows, chance = result["rows"], result["random_jaccard"]
    by = {(r[0], r[1]): r for r in rows}
    parts = []
    for selection in dict.fromkeys(r[0] for r in rows):
        dynamic, static = by[(selection, "per page")], by[(selection, "first page")]
        change = 100 * (static[2] - dynamic[2]) / dynamic[2] if dynamic[2] else 0.0
        parts.append(f"{selection}: consecutive pages share a Jaccard index of {dynamic[5]:.2f} on average "
                     f"({dynamic[6]:.2f} with the first page); freezing the first page's mask moves the KL from "
                     f"{dynamic[2]:.4g} to {static[2]:.4g} ({change:+.0f}%)")
    return "; ".join(parts) + f". Two random sets of the same size would share {chance:.2f}."


def run(model, tokenizer, *, tokens: int, selections: Sequence[str] = ("magnitude", "query"),
        base: CacheConfig = PRESETS["kitty"], progress: Progress | None = None) -> dict:
    return measure(model, text_ids(tokenizer, tokens, base), selections=selections, base=base, progress=progress)
