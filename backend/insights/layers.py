"""Per-layer sensitivity: the KL from FP16 when only one layer's cache is at 2 bits (keys and values, no boost,
the base's sink / page / window) and every other layer at FP16; then a layer-wise boost budget with the same
total of boosted channels (so exactly the same bytes) as a uniform alpha, shared out in proportion to that
sensitivity (or its square root), against the uniform alpha. Teacher-forced KL in the product cache.

The budgets are fitted to the sensitivity measured on the text, so they are also measured on a held-out text
(the bundled text's last tokens, disjoint from the first): a gain that shows only in-sample is overfitting."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..analysis import bundled_text
from ..cache import attention_layer_types
from ..engine import InputError
from ..methods import PRESETS, CacheConfig
from .common import (QUICK_BASE, Progress, config_settings, forced_quality, head_dim_of, layered_cache, phase,
                     record, sig, text_ids)

SETTINGS = {"full": dict(tokens=400, base=PRESETS["kitty"]), "quick": dict(tokens=96, base=QUICK_BASE)}
COLUMNS = ["allocation", "boosted channels (all layers)", "bits/element", "KL vs FP16 (nats/token)", "perplexity",
           "top-1 agreement with FP16", "held-out text: KL vs FP16", "held-out text: perplexity"]
RULES = {"proportional to KL": lambda kl: kl, "proportional to sqrt(KL)": np.sqrt}


def allocate(weights: Sequence[float], total: int, cap: int) -> list[int]:
    """Integers in proportion to `weights`, summing to `total`, none above `cap`: a layer whose share passes the
    cap gets the cap and the others share the rest again; the largest remainders take the leftover units."""
    w = np.clip(np.asarray(weights, dtype=float), 0.0, None)
    n = np.zeros(len(w), dtype=int)
    free = np.ones(len(w), dtype=bool)
    while True:
        left = total - n.sum()
        weight = np.where(free, w, 0.0)
        share = left * (weight / weight.sum() if weight.sum() > 0 else free / free.sum())
        over = free & (share > cap)
        if not over.any():
            break
        n[over], free = cap, free & ~over
    whole = np.floor(share).astype(int) * free
    n += whole
    leftover = total - n.sum()
    order = np.argsort(-np.where(free, share - whole, -1.0), kind="stable")
    n[order[:leftover]] += 1
    return n.tolist()


def measure(model, input_ids: torch.Tensor, held_out: torch.Tensor, *, base: CacheConfig = PRESETS["kitty"],
            progress: Progress | None = None) -> dict:
    """Sensitivity and budgets on input_ids, the budgets again on the held_out ids."""
    kinds = attention_layer_types(model.config)
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    fp16, two_bit = PRESETS["fp16"], replace(base, name="2-bit", alpha=0.0)
    single = {f"layer {i}": partial(layered_cache, model, [two_bit if j == i else fp16 for j in range(len(kinds))])
              for i in full}
    budgets_n = 1 + len(RULES)                                      # uniform and one per rule
    passes = (1 + len(single)) + budgets_n + (1 + budgets_n)          # FP16 + single layers; budgets; FP16 + budgets
    split = (1 + len(single)) / passes
    quality, reference = forced_quality(model, input_ids, single, progress=phase(progress, 0, split))
    kl = [quality[f"layer {i}"]["kl"] for i in full]
    head_dim = head_dim_of(model)
    uniform = base.boosted_channels(head_dim)
    allocations = {f"uniform (alpha {base.alpha:g})": [uniform] * len(full)}
    allocations.update({name: allocate(rule(np.array(kl)), uniform * len(full), head_dim)
                        for name, rule in RULES.items()})

    def budget_cache(counts: list[int]):
        per_layer = dict(zip(full, counts))
        return layered_cache(model, [replace(base, alpha=per_layer.get(j, 0) / head_dim) for j in range(len(kinds))])

    caches = {name: partial(budget_cache, counts) for name, counts in allocations.items()}
    middle = split + budgets_n / passes
    budgets, _ = forced_quality(model, input_ids, caches, reference=reference, progress=phase(progress, split, middle))
    unseen, _ = forced_quality(model, held_out, caches, progress=phase(progress, middle, 1.0))
    rows = [[name, int(sum(counts)), sig(budgets[name]["bits"]), sig(budgets[name]["kl"]),
             sig(budgets[name]["perplexity"]), sig(budgets[name]["agreement"]), sig(unseen[name]["kl"]),
             sig(unseen[name]["perplexity"])] for name, counts in allocations.items()]
    settings = {"text tokens": int(input_ids.shape[1]), "held-out tokens": int(held_out.shape[1]),
                "2-bit layer": config_settings(two_bit), "base": config_settings(base)}
    sensitivity = {"layers": full, "kl": [sig(v) for v in kl]}
    return record("layers", "Per-layer sensitivity and a layer-wise boost budget", model, settings, COLUMNS, rows,
                  summarize, sensitivity=sensitivity, allocations=allocations)


def summarize(result: dict) -> str:
    rows, layers, kl = result["rows"], result["sensitivity"]["layers"], result["sensitivity"]["kl"]
    order = np.argsort(kl)[::-1]
    top = ", ".join(f"{layers[i]} ({kl[i]:.3g})" for i in order[:3])
    share = sum(sorted(kl, reverse=True)[:3]) / sum(kl) if sum(kl) else 0.0
    uniform, others = rows[0], rows[1:]
    beats = lambda r, i: "beats" if r[i] < uniform[i] else "does not beat"         # noqa: E731
    verdicts = [f"{r[0]}: KL {r[3]:.4g} ({beats(r, 3)} the uniform {uniform[3]:.4g}), on the held-out text "
                f"{r[6]:.4g} ({beats(r, 6)} {uniform[6]:.4g})" for r in others]
    return (f"The most sensitive layers alone at 2 bits: {top}; together {100 * share:.0f}% of the summed single-"
            f"layer KL. With the same {uniform[1]} boosted channels: " + "; ".join(verdicts) + ".")


def run(model, tokenizer, *, tokens: int, base: CacheConfig = PRESETS["kitty"],
        progress: Progress | None = None) -> dict:
    """On the bundled text's first `tokens` tokens, the budgets also on its last `tokens` (disjoint)."""
    whole = tokenizer(bundled_text(), return_tensors="pt")["input_ids"]
    if 2 * tokens > whole.shape[1]:
        raise InputError(f"The layer study needs two disjoint texts of {tokens} tokens: at most "
                         f"{whole.shape[1] // 2} tokens each (the bundled text has {whole.shape[1]}).")
    return measure(model, text_ids(tokenizer, tokens, base), whole[:, -tokens:], base=base, progress=progress)
