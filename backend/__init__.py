"""Kitty Lab backend: the methods registry, the KV cache for `model.generate`, model loading.

    from backend import load_model, make_cache, METHODS
    model, tokenizer = load_model()
    cache = make_cache(model, "kitty")
    model.generate(**tokenizer(prompt, return_tensors="pt"), past_key_values=cache, max_new_tokens=64)
    cache.stats()
"""
from __future__ import annotations

import kernels  # noqa: F401  first: on a CPU-only machine it enables Triton's interpreter before triton loads

from .attention import use_kitty_attention
from .cache import CacheStats, KittyCache, LayerStats
from .methods import METHODS, PRESETS, CacheConfig, method_config
from .model import DEFAULT_MODEL, load_model


def make_cache(model, method: str | CacheConfig = "kitty", *, use_triton: bool | None = None,
               record_magnitudes: bool = True, reserve_tokens: int = 0, flush_spread: int | str = "auto",
               flush: str = "auto", decode_kernel: str = "auto", **settings) -> KittyCache:
    """A fresh cache for one generation. `method` is a preset name (METHODS), "custom", or a CacheConfig;
    keyword settings (k_bits, v_bits, sink, page_size, local_window, alpha, selection, seed) override it.

    use_triton: None picks Triton kernels for CUDA tensors and the PyTorch reference otherwise.
    record_magnitudes: keep each page's channel magnitudes for stats() (diagnostics, not cache bytes).
    reserve_tokens: set aside page storage for this many tokens per sequence up front, so long GPU runs
    never reallocate the page pools (by default they grow by exactly the pages needed).
    flush_spread: k > 1 spreads the quantization of buffers that fill at the same decode step (a batch of equal
    lengths) over k steps, ceil(B / k) sequences each, so no step stalls on the whole batch's pages; the pages
    are the same, a few tokens just stay full precision a few steps longer. 1 is the paper's schedule.
    "auto" (default): a spread by batch size, at most 16 sequences' pages a step (cache.auto_flush_spread; the same
    as 1 up to 16 sequences). On the H200 at 512 + 8,192 tokens it kept the slowest page-boundary step within 14 %
    of the ordinary steps around it (204 sequences, a spread of 13), where the paper's schedule takes 1.83x
    (BENCHMARKS.md section 2, session 19).
    flush: how a decode step's full buffers become pages. "torch": a batched quantize launch per kind between torch
    ops that choose channels, write the pool and table and shift the buffers (~33 launches a layer). "fused": one
    Triton kernel per kind does all of that (kernels/flush.py), the same pages (magnitudes up to float32 summation
    order); Triton also on a CPU (interpreted), whatever use_triton says. "auto" (default): fused for a cache on a
    GPU unless use_triton=False, torch otherwise. Random and query-aware channel selection always take the torch
    path.
    decode_kernel: the decode-attention kernel over a GPU cache's pages (kernels.decode_attention): "triton",
    "gluon" (kernels/decode_gluon.py, pages copied by cp.async; what it cannot take runs on Triton), "gluon-tma"
    (the same with TMA copies, Hopper only) or "auto" (default: "gluon-tma" on Hopper, with the experiments
    "+zq-ahead+fold-max" where its programs walk 32 pages or more (kernels.decode_attention.folds_max), and also
    "+q-rows" for kitty-pro's 32 boosted channels from 64 pages a program on a device whose memory reads 3.7 TB/s or
    more, as the H200's does and an H100 SXM's does not (reads_rows); "gluon" on other GPUs
    wherever it applies; the Gluon kernel was 1.2-1.6x faster than Triton at every shape the H200 measured, and its
    TMA copies 3-11 % faster than cp.async at 5 of 6 shapes, equal at the sixth: BENCHMARKS.md section 1, session
    16; the experiments 1.6-2.2 % faster at batch 64 / 32K in session 38, zq-ahead and fold-max faster at all 12
    shapes and methods of 32 to 86 pages a program and q-rows 0.3-1.0 % faster for kitty-pro at 64 / 32K in session
    39; on an H100, q-rows 1.7 % slower there, session 45). The experiments
    "gluon-tma-i8k" / "gluon-tma-i8" do the key (and value) products in 8-bit integers, which changes the numbers
    (kernels/i8_reference.py); a cache on a CPU decodes with their arithmetic, at any shape, so that their cost in
    accuracy can be measured there (`python -m backend.bench quality`).
    Switches `model` to the "kitty" attention function, which is plain SDPA for any other cache."""
    config = method if isinstance(method, CacheConfig) else method_config(method, **settings)
    use_kitty_attention(model)
    return KittyCache(config, model.config, use_triton=use_triton, record_magnitudes=record_magnitudes,
                      reserve_tokens=reserve_tokens, flush_spread=flush_spread, flush=flush,
                      decode_kernel=decode_kernel)


__all__ = ["load_model", "make_cache", "METHODS", "PRESETS", "CacheConfig", "method_config", "KittyCache",
           "CacheStats", "LayerStats", "DEFAULT_MODEL"]
