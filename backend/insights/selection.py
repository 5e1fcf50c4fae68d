"""Query-aware channel selection against the paper's magnitude ranking and random channels.

Kitty boosts the channels of a page with the largest mean |k|. What attention feels is the error of the scores
q . k: channel c's 2-bit error weighted by how strongly the queries read channel c. selection="query" ranks by
E[q_c^2] (running, causal) x the channel's mean squared 2-bit error on the page. Each (selection, alpha) runs in
the product cache on the same text: teacher-forced KL from FP16 and perplexity, then the pass-key questions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from .. import make_cache
from ..methods import PRESETS, SELECTIONS, CacheConfig
from ..teaching import filler_for, passkey_results
from .common import (QUICK_BASE, Progress, config_settings, forced_quality, head_dim_of, phase, record, sig,
                     text_ids)

ALPHAS = (1 / 16, 1 / 8, 1 / 4)
DEPTHS = (0.1, 0.5, 0.9)
SETTINGS = {"full": dict(tokens=1024, alphas=ALPHAS, depths=DEPTHS, base=PRESETS["kitty"]),
            "quick": dict(tokens=96, alphas=(1 / 8,), depths=(0.5,), base=QUICK_BASE)}
COLUMNS = ["selection", "alpha", "boosted channels", "KL vs FP16 (nats/token)", "perplexity", "perplexity / FP16",
           "top-1 agreement with FP16", "pass-key found"]


def run(model, tokenizer, *, tokens: int, alphas: Sequence[float] = ALPHAS, depths: Sequence[float] = DEPTHS,
        base: CacheConfig = PRESETS["kitty"], selections: Sequence[str] = SELECTIONS,
        progress: Progress | None = None) -> dict:
    """Every selection at every alpha, on `base`'s other settings: one table row each, FP16 first."""
    ids = text_ids(tokenizer, tokens, base)
    configs = {f"{selection} {alpha:g}": replace(base, name=f"{selection} {alpha:g}", alpha=float(alpha),
                                                 selection=selection)
               for alpha in alphas for selection in selections}
    quality, _ = forced_quality(model, ids, {label: partial(make_cache, model, config)
                                             for label, config in configs.items()}, progress=phase(progress, 0, 0.85))
    fillers = filler_for(tokenizer, tokens)          # pass-key prompts about as long as the text
    keys = passkey_results(model, tokenizer, {"fp16": PRESETS["fp16"], **configs}, depths,
                           filler_sentences=fillers, progress=phase(progress, 0.85, 1.0))
    head_dim = head_dim_of(model)
    fp16 = quality["fp16"]
    found = lambda label: f"{sum(a['found'] for a in keys[label])}/{len(depths)}"   # noqa: E731
    rows = [["fp16 (reference)", 0.0, 0, 0.0, sig(fp16["perplexity"]), 1.0, 1.0, found("fp16")]]
    for label, config in configs.items():
        m = quality[label]
        rows.append([config.selection, sig(config.alpha), config.boosted_channels(head_dim), sig(m["kl"]),
                     sig(m["perplexity"]), sig(m["perplexity"] / fp16["perplexity"]), sig(m["agreement"]),
                     found(label)])
    settings = {"text tokens": tokens, "alphas": [sig(a) for a in alphas], "pass-key depths": list(depths),
                "pass-key prompt sentences": fillers, "base": config_settings(base)}
    return record("selection", "Query-aware channel selection vs magnitude and random", model, settings, COLUMNS,
                  rows, summarize)


def summarize(result: dict) -> str:
    """Plain words from the table: does query-aware beat magnitude at each alpha, and how does it compare with
    magnitude at twice the boosted channels?"""
    rows = result["rows"]
    kl = {(r[0], r[1]): r[3] for r in rows[1:]}
    channels = {r[1]: r[2] for r in rows[1:]}
    ppl = {(r[0], r[1]): r[5] for r in rows[1:]}
    alphas = sorted({a for _, a in kl})
    if not all(("query", a) in kl and ("magnitude", a) in kl for a in alphas):
        return "Query-aware and magnitude selection were not both measured."
    parts, wins = [], 0
    for a in alphas:
        q, m = kl[("query", a)], kl[("magnitude", a)]
        wins += q < m
        change = f"{100 * (m - q) / m:.0f}% lower" if q < m else f"{100 * (q - m) / m:.0f}% higher" if m else "equal"
        parts.append(f"alpha {a:g} ({channels[a]} channels): KL {q:.4g} vs {m:.4g} ({change}), "
                     f"perplexity {ppl[('query', a)]:.3f} vs {ppl[('magnitude', a)]:.3f} x FP16")
    verdict = ("Query-aware selection beats magnitude at every alpha" if wins == len(alphas) else
               "Query-aware selection does not beat magnitude at every alpha" if wins else
               "Query-aware selection does not beat magnitude")
    doubled = [f"query at {a:g} {kl[('query', a)]:.4g} vs magnitude at {2 * a:g} {kl[('magnitude', 2 * a)]:.4g}"
               for a in alphas if ("magnitude", 2 * a) in kl]
    return f"{verdict}: " + "; ".join(parts) + "." + (f" Against magnitude with twice the boosted channels (KL): "
                                                      f"{'; '.join(doubled)}." if doubled else "")

