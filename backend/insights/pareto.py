"""The Pareto frontier over sink S, value window R, page size G and boost share alpha: bits per stored key /
value element against the teacher-forced KL from FP16, the paper's defaults marked.

Bits are what the cache holds at the end of the text (16-bit sink, buffers and window, pages with their
metadata), and, by the layout's arithmetic, what the same settings would hold at a long length, where the
full-precision parts weigh little; the KL is measured on the text, so the long-length frontier assumes it holds.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from .. import make_cache
from ..memory import fp16_sequence_bytes, sequence_bytes
from ..methods import PRESETS, CacheConfig
from .common import QUICK_BASE, Progress, config_settings, forced_quality, record, sig, text_ids

SETTINGS = {"full": dict(tokens=512, sinks=(0, 32), windows=(32, 128), pages=(64, 128), alphas=(0.0, 0.125, 0.25),
                         long_tokens=32768, base=PRESETS["kitty"]),
            "quick": dict(tokens=96, sinks=(0, 8), windows=(32,), pages=(32,), alphas=(0.0, 0.25),
                          long_tokens=4096, base=QUICK_BASE)}
DEFAULTS = {(32, 128, 128, 0.125): "kitty", (32, 128, 128, 0.25): "kitty-pro"}


def columns(long_tokens: int) -> list[str]:
    return ["sink S", "window R", "page G", "alpha", "bits/element (this text)", f"bits/element ({long_tokens} tokens)",
            "KL vs FP16 (nats/token)", "perplexity", "frontier (this text)", f"frontier ({long_tokens} tokens)",
            "paper default"]


COLUMNS = columns(SETTINGS["full"]["long_tokens"])


def frontier(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Which (bits, KL) points no other point beats on both (fewer or equal bits and lower KL)."""
    best, flags = float("inf"), [False] * len(points)
    for i in sorted(range(len(points)), key=lambda i: points[i]):
        if points[i][1] < best:
            best, flags[i] = points[i][1], True
    return flags


def measure(model, input_ids: torch.Tensor, *, sinks: Sequence[int], windows: Sequence[int], pages: Sequence[int],
            alphas: Sequence[float], long_tokens: int, base: CacheConfig = PRESETS["kitty"],
            progress: Progress | None = None) -> dict:
    grid = {(s, r, g, float(a)): replace(base, name=f"S{s} R{r} G{g} alpha {a:g}", sink=s, local_window=r,
                                         page_size=g, alpha=float(a))
            for s, r, g, a in itertools.product(sinks, windows, pages, alphas)}
    quality, _ = forced_quality(model, input_ids, {config.name: partial(make_cache, model, config)
                                                   for config in grid.values()}, progress=progress)
    long_bits = {key: 16 * sequence_bytes(config, model.config, long_tokens) / fp16_sequence_bytes(model.config,
                                                                                                      long_tokens)
                 for key, config in grid.items()}
    keys = list(grid)
    here = frontier([(quality[grid[k].name]["bits"], quality[grid[k].name]["kl"]) for k in keys])
    far = frontier([(long_bits[k], quality[grid[k].name]["kl"]) for k in keys])
    rows = []
    for key, on_here, on_far in zip(keys, here, far):
        m = quality[grid[key].name]
        rows.append([*key[:3], sig(key[3]), sig(m["bits"], 3), sig(long_bits[key], 3), sig(m["kl"]),
                     sig(m["perplexity"]), on_here, on_far, DEFAULTS.get(key, "")])
    settings = {"text tokens": int(input_ids.shape[1]), "long length": long_tokens, "sinks": list(sinks),
                "windows": list(windows), "pages": list(pages), "alphas": list(alphas), "base": config_settings(base)}
    return record("pareto", "Pareto frontier over sink, window, page size and alpha", model, settings,
                  columns(long_tokens), rows, summarize)


def summarize(result: dict) -> str:
    rows, tokens, long_tokens = result["rows"], result["settings"]["text tokens"], result["settings"]["long length"]
    name = lambda r: f"S{r[0]} R{r[1]} G{r[2]} alpha {r[3]:g}"                # noqa: E731
    parts = []
    for flag, bits, label in ((8, 4, f"at {tokens} tokens (this text)"), (9, 5, f"at {long_tokens} tokens")):
        line = sorted((r for r in rows if r[flag]), key=lambda r: r[bits])
        points = ", ".join(f"{name(r)} ({r[bits]:.2f} bits, KL {r[6]:.3g})" for r in line)
        defaults = [f"{r[10]} is {'on' if r[flag] else 'off'} it" for r in rows if r[10]]
        parts.append(f"Frontier {label}: {points}" + (f"; {', '.join(defaults)}" if defaults else ""))
    return ". ".join(parts) + "."


def run(model, tokenizer, *, tokens: int, sinks: Sequence[int], windows: Sequence[int], pages: Sequence[int],
        alphas: Sequence[float], long_tokens: int, base: CacheConfig = PRESETS["kitty"],
        progress: Progress | None = None) -> dict:
    # long enough for a key page of the largest sink and page (the widest windows may keep values at FP16)
    needs = replace(base, sink=max(sinks), page_size=max(pages), local_window=min(windows))
    return measure(model, text_ids(tokenizer, tokens, needs), sinks=sinks, windows=windows, pages=pages,
                   alphas=alphas, long_tokens=long_tokens, base=base, progress=progress)
