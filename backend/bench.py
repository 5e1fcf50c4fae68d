"""Benchmarks that tell the truth: one command, one table, medians, ratios measured in the same run.

    python -m backend.bench attention [--batches 1 8 64] [--lengths 4096 32768] [--out results.json]
    python -m backend.bench generate  [--budget-gb 80] [--prompt 512] [--new-tokens 8192] [--flush-spread 8]
                                      [--flush fused] [--prefill-chunk 4096] [--out results.json]
    python -m backend.bench generate --quick --prefill-chunk 16       # chunked prefill, tiny shapes on a CPU
    python -m backend.bench generate --new-tokens 8192 --sample-contexts 5   # estimated from 5 sampled contexts
    python -m backend.bench attention --quick --out results.json      # tiny shapes on a CPU, under a minute
    python -m backend.bench compare [--methods fp16 kivi-k2v2 kitty] [--new-tokens 64] [--repeat 2]
    python -m backend.bench turn [--prompt 8192] [--new-tokens 256] [--batch 16]   # a chat's next turn, ragged
    python -m backend.bench quality [--methods kitty-pro kivi-k2v2] [--kernels auto gluon-tma-i8k] [--prompt 1040]
    python -m backend.bench plot results.json                          # figures (HTML, PNG) from saved results

attention: decode attention of one query per sequence over a cache of L tokens, Qwen3-8B attention shape
(32 query heads, 8 KV heads, head_dim 128): our kernel on kitty / kitty-pro / kivi-k2v2 / fp16 caches, torch
SDPA over FP16 K/V (the anchor's baseline), and transformers' QuantizedCache read path (quanto, 2 and 4 bits:
dequantize everything, then SDPA). Medians of CUDA-graph replays (triton.testing), effective GB/s = bytes the
method must read / time, next to the device-to-device copy bandwidth measured in the same run.

generate: a Qwen3-8B-shaped model with random weights under one memory budget: for each method the largest
batch that fits, tokens/s there, time to first token, per-step latency p50 / p99 / max, and how much the
page-boundary quantization steps cost. --prefill-chunk N feeds the prompt through the cache N tokens at a time
(generate's prefill_chunk_size, for every method): a long prompt's activations and full-precision keys then never
exist for the whole prompt at once, so the prefill peak no longer limits the batch. On a GPU, Kitty caches replay
their decode steps as CUDA graphs (backend.graphs; --eager turns that off), transformers' caches run eagerly as
generate runs them; each row says which. --sample-contexts N estimates each row instead of running it whole (a
generation longer than a device call allows: sampled_generate), and the row says `estimated`.

turn: a chat's next turn on a ragged batch: each sequence's cache holds a first turn of its own length (from the
whole --prompt down to about half), then --new-tokens tokens go through the model in one timed forward, for each
method (a Kitty cache attends over its pages dequantized, sink and buffers, and the turn's tokens: _attend_chunk).

compare: what a visitor waits for: one comparison of the page (default model, default prompt, the methods at once,
one thread each) until every answer is complete, and until each is also scored against FP16 (teacher forcing).

quality: teacher-forced KL from the full-precision default model over the bundled text, for each method and decode
kernel: what the 8-bit kernels' arithmetic costs in accuracy (on a CPU emulated by kernels/i8_reference.py at any
shape; on a GPU the kernels themselves where they apply) beside what the cache's quantization costs.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

# on a CPU: Triton interpreted
from kernels.decode_attention import (FOLDED_KERNEL, GLUON_MAXNREG, GLUON_MAXNREG_FEW, KERNELS, MAXNREG,
                                      ROWS_KERNEL, DecodeWorkspace, check_kernel, choose_kernel, decode_attention,
                                      decode_launches, default_splits, device_memory_gbs, gluon_maxnreg, is_gluon,
                                      multiprocessors, resident_programs, split_count)
from kernels.decode_rest import KEY_READS, TIMES_ROW, rest_blocks, rest_parts
from kernels.layout import key_page_bytes, value_page_bytes

from . import memory
from .cache import FLUSH_MODES, KittyLayer, auto_flush_spread
from .graphs import CudaGraphDecoding
from .methods import method_config

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
CACHE_METHODS = ("kitty", "kitty-pro", "kivi-k2v2", "fp16")
# bench attention --pdl: decode_attention's pdl (None: its default)
PDL_CHOICES = {"default": (None,), "off": (False,), "on": (True,), "both": (False, True)}


# ---------------------------------------------------------------------------------------------- timing
def median_seconds(fn, quick: bool) -> float:
    """Median time of fn: CUDA-graph replays on a GPU (no launch gaps), wall clock on a CPU."""
    if torch.cuda.is_available():
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3
        except RuntimeError:                          # not capturable (quanto's Python-side tensors)
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(1 if quick else 5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_us(fn, calls: int = 20) -> dict[str, float]:
    """Mean device time of each GPU kernel fn launches, per call of fn (torch.profiler's CUDA activity): beside
    median_seconds' total, it says how much of a call is each kernel and how much is the gaps between them.
    Comparisons use median_seconds, never these: they are eager launches timed by CUPTI, and in the one H200 run
    that compared them they read the paged launch alone at batch 64 / 32K 6.5 % slower than its graph replays
    (410.4 against 385.3 µs; BENCHMARKS.md section 1, session 30, item 2; why is not yet measured). Graph replays
    are also how generate runs a Kitty cache's decode steps (backend.graphs)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            times[event.key] = times.get(event.key, 0.0) + event.device_time_total / calls
    return times


def copy_bandwidth() -> float | None:
    """Device-to-device copy GB/s, bytes read + written (the ceiling for memory-bound kernels)."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median") / 1e3
    return 2 * src.numel() / seconds / 1e9


# The files whose contents decide a measured figure: their git blob ids go with every result, because the device
# machine receives a copy of the working tree without the session's commits (`git log --find-object=ID` here
# names the commits that hold a file as measured).
MEASURED_SOURCES = ("kernels/decode_attention.py", "kernels/decode_gluon.py", "kernels/quantize.py", "kernels/flush.py",
                    "kernels/dequantize.py", "backend/cache.py", "kernels/chunk_attention.py", "backend/graphs.py",
                    "backend/bench.py")


def git_blob_id(path: Path) -> str:
    """The id `git hash-object` gives the file's contents."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def environment(program: str = "python -m backend.bench") -> dict:
    """The run's date, GPU, versions, command line (`program` and this process's arguments) and the git blob ids of
    the files that decide its figures (MEASURED_SOURCES)."""
    import transformers
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    root = Path(__file__).resolve().parent.parent
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "memory_gbs": device_memory_gbs(torch.device("cuda")) if gpu else None, **gpu_power_limits(),
            "command": " ".join([program, *sys.argv[1:]]),
            "sources": {name: git_blob_id(root / name) for name in MEASURED_SOURCES}}


# ---------------------------------------------------------------------------------------------- attention
def random_kv(batch, heads, length, dim, dtype, device, seed=0):
    """Keys with a few loud channels (as real keys have) and plain random values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    loud = 1 + 4 * (torch.rand(heads, 1, dim, generator=gen, device=device) > 0.9)
    k = (torch.randn(batch, heads, length, dim, generator=gen, device=device) * loud).to(dtype)
    v = torch.randn(batch, heads, length, dim, generator=gen, device=device).to(dtype)
    return k, v


def filled_layer(method: str, k: torch.Tensor, v: torch.Tensor) -> KittyLayer:
    layer = KittyLayer(method_config(method), use_triton=True if k.is_cuda else None, record_magnitudes=False,
                       reserve_tokens=k.shape[2])
    layer.lazy_initialization(k, v)
    layer._append(k, v, np.full(k.shape[0], k.shape[2]))
    return layer


def bytes_read(layer: KittyLayer) -> int:
    """Bytes one decode step must read: every stored token's share of pages, metadata and 16-bit buffers."""
    return sum(layer.used_bytes())


def quanto_read_path(k, v, nbits):
    """transformers' QuantizedCache (quanto backend) after prefill, and its per-step read: dequantize the
    whole quantized cache, append the full-precision residual, SDPA. None when quanto is not installed."""
    try:
        from transformers.cache_utils import QuantoQuantizedLayer
    except ImportError:
        return None
    try:
        layer = QuantoQuantizedLayer(nbits=nbits, residual_length=128)
        layer.update(k, v)
    except Exception as exc:                          # optimum-quanto missing or incompatible
        print(f"  QuantizedCache quanto int{nbits} unavailable: {exc}", file=sys.stderr)
        return None

    def read(q):
        keys = torch.cat([layer._dequantize(layer._quantized_keys), layer.keys], dim=-2)
        values = torch.cat([layer._dequantize(layer._quantized_values), layer.values], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    quantized_bytes = sum(t.numel() * t.element_size() for t in _quanto_tensors(layer))
    return read, quantized_bytes


def _quanto_tensors(layer):
    for qt in (layer._quantized_keys, layer._quantized_values):
        for name in ("_data", "_scale", "_shift"):
            t = getattr(qt, name, None)
            if isinstance(t, torch.Tensor):
                yield t
    yield layer.keys
    yield layer.values


def bench_attention(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hq, h, d = (32, 8, 128) if not args.quick else (8, 2, 64)
    batches = args.batches or ([1, 8, 64] if not args.quick else [1, 2])
    lengths = args.lengths or ([4096, 32768] if not args.quick else [300])
    methods = args.methods or list(CACHE_METHODS)
    copy_gbs = copy_bandwidth()
    rows = []
    for length in lengths:
        for batch in batches:
            k, v = random_kv(batch, h, length, d, dtype, device)
            q = torch.randn(batch, hq, d, device=device, dtype=dtype)
            sm_scale = d ** -0.5
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q[:, :, None], k, v, scale=sm_scale, enable_gqa=True)
            sdpa_s = median_seconds(sdpa, args.quick)
            fp16_bytes = 2 * k.numel() * k.element_size()
            rows.append(dict(batch=batch, tokens=length, method="sdpa-fp16", us=sdpa_s * 1e6,
                             gbs=fp16_bytes / sdpa_s / 1e9, vs_sdpa=1.0, max_err=0.0))
            reference = sdpa()[:, :, 0].float()
            for method in methods:
                layer = filled_layer(method, k, v)
                kv = layer.paged()
                for kernel, pdl in ((k, p) for k in args.kernels for p in PDL_CHOICES[args.pdl]):
                    launches = decode_launches(q, kv, sm_scale, workspace=DecodeWorkspace(), kernel=kernel, pdl=pdl)
                    err = (launches().float() - reference).abs().max().item()  # vs exact FP16: quantization error
                    seconds = median_seconds(launches, args.quick)
                    # each of the call's three launches alone (the remaining blocks, the paged slots, the merge), on
                    # the buffers of the call just made: what the call's time is made of, and its gaps. Launched
                    # without PDL: replays of one launch chained by PDL would overlap each other
                    alone = decode_launches(q, kv, sm_scale, workspace=DecodeWorkspace(), kernel=kernel, pdl=False)
                    alone()
                    parts_us = {f"{part}_us": median_seconds(getattr(alone, part), args.quick) * 1e6
                                for part in ("remaining", "paged", "merge")}
                    name = (method if kernel == "auto" else f"{method}/{kernel}") + {None: "", False: "-pdl",
                                                                                      True: "+pdl"}[pdl]
                    ran = choose_kernel(q, kv) if kernel == "auto" else kernel      # what "auto" took
                    rows.append(dict(batch=batch, tokens=length, method=name, kernel=kernel, pdl=pdl, ran=ran,
                                     us=seconds * 1e6, **parts_us, gbs=bytes_read(layer) / seconds / 1e9,
                                     vs_sdpa=sdpa_s / seconds, max_err=err))
                del layer, kv
            if device == "cuda":
                for nbits in (4, 2):
                    found = quanto_read_path(k, v, nbits)
                    if found is None:
                        continue
                    read, nbytes = found
                    seconds = median_seconds(lambda: read(q[:, :, None]), args.quick)
                    rows.append(dict(batch=batch, tokens=length, method=f"hf-quanto-int{nbits}", us=seconds * 1e6,
                                     gbs=nbytes / seconds / 1e9, vs_sdpa=sdpa_s / seconds, max_err=None))
            del k, v
            if device == "cuda":
                torch.cuda.empty_cache()
            print_rows([r for r in rows if r["batch"] == batch and r["tokens"] == length], header=len(rows) <= 8)
    return {"kind": "attention", "shape": {"query_heads": hq, "kv_heads": h, "head_dim": d, "dtype": str(dtype)},
            "copy_gbs": copy_gbs, "rows": rows, "env": environment()}


TUNE_SWEEPS = ("splits", "maxnreg", "stages", "warps", "kernel", "gluon-splits", "gluon-maxnreg", "gluon-tma", "rest",
               "rest-pdl", "rest-blocks", "rest-keys", "pdl", "i8", "loads", "timeline", "pad", "experiments")


# A tune setting's fields but its split (which the shape decides), at the default launch: 1 warp, 3 stages, the Triton
# kernel at MAXNREG, the remaining blocks' defaults, no PDL, the whole launch, no timeline or padding
TUNE_DEFAULTS = dict(warps=1, stages=3, maxnreg=MAXNREG, kernel="triton", rest_warps=None, pdl=False, loads=None,
                     rest_maxnreg=None, timeline=False, pad=None, rest_blocks=None, rest_keys=None)


def bench_tune(args) -> dict:
    """The decode kernel's launch settings for each method (default kitty-pro), at each shape: programs over the paged
    blocks of each (sequence, KV head), register caps, pipeline depths and warps per program, with the default choice
    marked.
    What the defaults (default_splits, balanced_splits, MAXNREG, GLUON_MAXNREG) were set from."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hq, h, d = (32, 8, 128) if not args.quick else (8, 2, 64)
    batches = args.batches or ([1, 8, 64] if not args.quick else [1])
    lengths = args.lengths or ([4096, 32768] if not args.quick else [300])
    methods = args.methods or ["kitty-pro"]
    sm_count = multiprocessors(torch.device(device))
    from kernels.decode_gluon import resident_programs as gluon_resident
    from kernels.decode_gluon import supports_tma as gluon_supports_tma
    rows = []
    # every method, length and batch in turn, one cache at a time
    for method, length, batch in itertools.product(methods, lengths, batches):
        k, v = random_kv(batch, h, length, d, dtype, device)
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        layer = filled_layer(method, k, v)
        kv = layer.paged()
        pages = max(1, kv.k_table.shape[1])
        chosen = default_splits(batch, h, pages, sm_count)
        # the split count around the default (1 warp, 3 stages, register cap MAXNREG), then at the default split
        # other register caps (a cap buys resident programs with spills), pipeline depths and two warps per
        # program (each a half of every page: no spills at 128 registers, a third more instructions in all); then
        # the Gluon kernel's settings
        splits = sorted({max(1, min(pages, chosen * f // 4)) for f in (2, 4, 6, 8)})
        base = dict(TUNE_DEFAULTS, splits=chosen)

        default_gluon = choose_kernel(q, kv)            # its copies: by TMA on Hopper, else cp.async
        default_gluon = default_gluon if is_gluon(default_gluon) else "gluon"

        # the default Gluon kernel's register cap at its own split (gluon_maxnreg)
        cap = gluon_maxnreg(q, kv, split_count(q, kv, default_gluon, GLUON_MAXNREG))

        def gluon(maxnreg, quarters=4, splits=None, kernel=None):
            """A Gluon kernel (default: the one "auto" takes) at a register cap, at quarters / 4 of the split it
            chooses (or at `splits`)."""
            kernel = kernel or default_gluon
            own = splits or split_count(q, kv, kernel, maxnreg)
            return {**base, "kernel": kernel, "maxnreg": maxnreg,
                    "splits": max(1, min(pages, own * quarters // 4))}

        sweeps = {"splits": [{**base, "splits": n} for n in splits],
                  "maxnreg": [{**base, "maxnreg": r} for r in (255, 168, 128, 96) if r != MAXNREG],
                  "stages": [{**base, "stages": stages} for stages in (1, 2, 4)],
                  "warps": [{**base, "warps": 2, "maxnreg": r} for r in (128, 96)],
                  # the Gluon kernel over the paged blocks at its register cap, at half and twice its split and at
                  # one full wave of the programs its registers leave resident (the split before session 16's
                  # balanced_splits), and at other caps (resident programs against spills), each at the split its
                  # programs choose
                  "kernel": [gluon(GLUON_MAXNREG)],
                  "gluon-splits": [gluon(GLUON_MAXNREG, f) for f in (2, 8)] + [gluon(GLUON_MAXNREG, splits=(
                      default_splits(batch, h, pages, sm_count, gluon_resident(kv, d, GLUON_MAXNREG))))],
                  "gluon-maxnreg": [gluon(r) for r in (128, 136, 144, 152, 160, 176, 192, 255)],
                  # both copy paths (cp.async, TMA: kernel "gluon-tma") at both default caps
                  "gluon-tma": [gluon(r, kernel=k) for k in ("gluon", "gluon-tma")
                                for r in (GLUON_MAXNREG, GLUON_MAXNREG_FEW)],
                  # the remaining blocks' launch (kernels/decode_rest.py) beside either kernel: warps a program
                  # (None: decode_rest.rest_warps, by the launch's programs)
                  "rest": [{**setting, "rest_warps": w} for setting in (base, gluon(GLUON_MAXNREG))
                           for w in (1, 2, 4)],
                  # ... and beside the default kernel by PDL (the default launch: 2 warps at 168 registers for
                  # programs of 3 blocks or more, decode_rest.rest_maxnreg), and at the compiler's cap, the earlier
                  # default (1 warp, 2 at 96, 4 at the compiler's cap and at 128 and 1 at 168 were slower on an
                  # H100 in both replicates: BENCHMARKS.md section 1, session 37)
                  "rest-pdl": [{**gluon(cap), "pdl": True, "rest_warps": w, "rest_maxnreg": r}
                               for w, r in ((None, None), (2, 255))],
                  # ... and at blocks a program (None: decode_rest.rest_blocks_per_program; 9 is all of a
                  # Qwen3-8B kitty-pro sequence's at 32K)
                  "rest-blocks": [{**gluon(cap), "pdl": True, "rest_blocks": n} for n in (None, 1, 2, 3, 5, 9)],
                  # ... and each way a key page's remaining blocks read its codes (decode_rest.KEY_READS; the
                  # default, decode_attention.REST_KEYS, chooses between them by the launch)
                  "rest-keys": [{**gluon(cap), "pdl": True, "rest_keys": k} for k in KEY_READS],
                  # the default Gluon kernel at its default cap and split, with its three launches in a row and
                  # chained by programmatic dependent launch (decode_launches' pdl)
                  "pdl": [{**gluon(cap), "pdl": p} for p in (False, True)],
                  # the 8-bit products' kernels at the default cap and at 128 registers, 16 programs a
                  # multiprocessor instead of 12: gluon-tma-i8k's page loop fits 128 without spills (the fp16
                  # kernel's spills 9 loads and stores a page there), each at the split its programs choose;
                  # with the default kernel at its own cap for the same run
                  "i8": [gluon(cap)] + [gluon(r, kernel=k) for k in ("gluon-tma-i8k", "gluon-tma-i8")
                                        for r in (GLUON_MAXNREG, 128)],
                  # the memory pipeline's ceiling: the default Gluon kernel's paged launch with its copies and
                  # barriers and no products (decode_gluon's COMPUTE=False; not attention), at the splits of 12
                  # and 16 programs a multiprocessor (its own registers never limit it), beside the whole kernel;
                  # and the arithmetic's own time: the same launch with its products and barriers and no copies
                  # (COPIES=False), at its cap and at 16 programs a multiprocessor (128 registers, with spills:
                  # whether more warps would hide its latencies)
                  "loads": [gluon(cap)] + [{**gluon(r), "loads": half} for half in ("copies", "arithmetic")
                                           for r in (GLUON_MAXNREG, 128)],
                  # when each program of the default kernel's paged launch starts and ends, and where (the launch
                  # alone, and its arithmetic alone): how long the multiprocessors hold fewer programs than they
                  # can (ncu: about 10 of 12 warps active on average at batch 64 / 32K, session 24)
                  # and (the page loop then reads the clock around its waits) how long its programs waited for
                  # their key pages and their value pages; and whether 8 launches in a row, eager and in one CUDA
                  # graph, overlap or leave gaps (back_to_back); and a whole call by PDL (the default), with the
                  # remaining blocks' programs too: when they start and end against the paged programs, the tail
                  # that a call adds to its paged launch (call_timeline)
                  "timeline": [{**gluon(cap), "loads": half, "timeline": t} for half, t in (
                      ("whole", True), ("arithmetic", True), ("whole", "waits"))]
                  + [{**gluon(cap), "pdl": True, "timeline": "call"}],
                  # what one more instruction of each kind costs the default kernel's paged launch: 64 and 128
                  # more LOP3 (the integer pipe, as the unpacking's ANDs), FFMA (the multiply-add pipe) a page,
                  # and 8 and 16 more HMMA (the matrix unit), on its scores, adding nothing (decode_gluon's PAD)
                  "pad": [{**gluon(cap), "loads": "whole", "pad": pad} for pad in (
                      None, ("alu", 64), ("alu", 128), ("fma", 64), ("fma", 128), ("mma", 8), ("mma", 16))],
                  # the Gluon kernel's experiments (decode_attention.GLUON_EXPERIMENTS) against the plain kernel,
                  # each whole, its paged launch alone and its arithmetic alone, with the GPU's clock and power: the
                  # keys' zero terms 16 pages a product, and with the exponent's multiply-add folding the scores'
                  # weights (FOLDED_KERNEL, what "auto" takes for launches of many pages a program), and with the
                  # boosted channels' queries from a transposed copy (ROWS_KERNEL, kitty-pro's longest launches)
                  "experiments": [{**gluon(cap, kernel=k), "loads": half} for k in (
                      "gluon-tma", "gluon-tma+zq-ahead", FOLDED_KERNEL, ROWS_KERNEL)
                      for half in (None, "whole", "arithmetic")]}
        settings = [base] + [s for name in args.vary for s in sweeps[name] if s != base]
        settings = [s for i, s in enumerate(settings) if s not in settings[:i]
                    and (not (s["loads"] or s["timeline"]) or gluon_supports_tma(q, kv))]  # the halves, timelines
        for setting in settings:
            run = lambda: decode_attention(q, kv, d ** -0.5, num_splits=setting["splits"],  # noqa: E731
                                           num_warps=setting["warps"], num_stages=setting["stages"],
                                           maxnreg=setting["maxnreg"], kernel=setting["kernel"],
                                           rest_warps=setting["rest_warps"], pdl=setting["pdl"],
                                           rest_maxnreg=setting["rest_maxnreg"],
                                           rest_blocks=setting["rest_blocks"], rest_keys=setting["rest_keys"])
            times = None
            if setting["timeline"]:
                times = torch.zeros(batch * h * setting["splits"], TIMES_ROW.value, dtype=torch.int64,
                                    device=device)
            if setting["timeline"] == "call":
                # the remaining blocks' programs: at most one a block (rest_parts with one block a program)
                rest_times = torch.zeros(batch * h * rest_parts(kv), TIMES_ROW.value, dtype=torch.int64,
                                         device=device)
                run = decode_launches(q, kv, d ** -0.5, num_splits=setting["splits"], maxnreg=setting["maxnreg"],
                                      kernel=setting["kernel"], pdl=True, times=(times, rest_times),
                                      rest_blocks=setting["rest_blocks"])
            if setting["loads"]:
                run = paged_half(q, kv, setting["splits"], setting["maxnreg"], setting["loads"], times,
                                 setting["pad"], setting["timeline"] == "waits", setting["kernel"])
            # each setting's launches in an NVTX range, so that Nsight Compute can profile one of them
            # (backend.kernel_profile --command tune --nvtx-range NAME)
            with nvtx_range(tune_range(setting), device):
                seconds = median_seconds(run, args.quick)
                kernels = kernel_us(run) if device == "cuda" else {}
            clocks = gpu_clocks(run, device)
            rows.append(dict(batch=batch, tokens=length, method=method, **setting, default=setting == base,
                             us=seconds * 1e6, gbs=bytes_read(layer) / seconds / 1e9, kernels_us=kernels,
                             paged_gbs=paged_bytes(kv) / seconds / 1e9, **clocks))
            if setting["timeline"] == "call":
                rows[-1]["call"] = call_timeline(times.cpu(), rest_times.cpu())
                print("    call timeline:", ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["call"].items()))
            elif times is not None:
                rows[-1]["programs"] = timeline(times.cpu())
                print("    timeline:", ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["programs"].items()))
                rows[-1]["launches"] = back_to_back(lambda t: paged_half(
                    q, kv, setting["splits"], setting["maxnreg"], setting["loads"], t, setting["pad"],
                    setting["timeline"] == "waits", setting["kernel"]), times.shape[0], device)
                for mode, summary in rows[-1]["launches"].items():
                    print(f"    8 launches, {mode}:", ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
            print(f"{method} {batch:>3} {length:>6} "
                  + " ".join(f"{k} {int(v) if isinstance(v, (int, float)) else v}" for k, v in setting.items())
                  + f"{' (default)' if setting == base else ''}: {seconds * 1e6:9.1f} us "
                  f"{rows[-1]['gbs']:7.0f} GB/s (pages {rows[-1]['paged_gbs']:5.0f})"
                  + "".join(f" | {name[:24]} {us:.1f} (profiler)" for name, us in kernels.items())
                  + "".join(f" | {name} {value:#x}" if name == "clock_reasons" else f" | {name} {value:.0f}"
                            for name, value in clocks.items()), flush=True)
        del layer, kv, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"kind": "tune", "rows": rows, "env": environment()}


def tune_range(setting: dict) -> str:
    """The NVTX range of a tune setting's launches: its paged kernel, its half (bench tune --vary loads: copies,
    arithmetic, or whole) and its register cap, e.g. "gluon-tma.arithmetic.168"."""
    return f"{setting['kernel']}.{setting['loads'] or 'whole'}.{setting['maxnreg']}"


# nvidia-smi's fields sampled while a row's launches run, and the row's names for them. The temperatures are there
# because at a power cap a hotter chip leaks more of the power the cap allows, so the same launch runs at a lower
# clock on a hotter machine (H200s of one kind differed by 2-5 % in session 44: BENCHMARKS.md section 1).
CLOCK_FIELDS = {"clocks.sm": "sm_mhz", "power.draw": "power_w", "clocks_event_reasons.active": "clock_reasons",
                "temperature.gpu": "gpu_c", "temperature.memory": "memory_c"}
CLOCK_QUERY = ",".join(CLOCK_FIELDS)
POWER_LIMITS = ("power.limit", "enforced.power.limit", "power.max_limit")


def smi_index() -> str:
    """nvidia-smi's index of the GPU this process uses (the first visible one)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", str(torch.cuda.current_device())).split(",")[0]


def gpu_power_limits() -> dict[str, float]:
    """The GPU's power limits in W (nvidia-smi's POWER_LIMITS, as {"power_limit_w", ...}): machines of one kind
    have differed in how fast they run the power-capped decode launch (BENCHMARKS.md section 1, session 44), whose
    time is about its energy over the power the cap leaves, so each result names its cap. Empty without a GPU."""
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return {}
    answer = subprocess.run(["nvidia-smi", "-i", smi_index(), f"--query-gpu={','.join(POWER_LIMITS)}",
                             "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return parse_power_limits(answer)


def parse_power_limits(answer: str) -> dict[str, float]:
    """nvidia-smi's "limit, enforced limit, max limit" line -> {"power_limit_w": ..., ...}, leaving out the values
    it could not read ("[N/A]")."""
    limits = {}
    for name, value in zip(POWER_LIMITS, answer.strip().split(",")):
        try:
            limits[name.replace(".", "_") + "_w"] = float(value)
        except ValueError:
            continue
    return limits


def gpu_clocks(fn, device: str, seconds: float = 1.5) -> dict[str, float]:
    """The GPU's multiprocessor clock, power draw and temperatures while fn's launches run back to back for
    `seconds`, and why its clock is held down: the medians of nvidia-smi's samples every 10 ms ({"sm_mhz", "power_w",
    "gpu_c", "memory_c"}) and their most frequent clock event reasons ("clock_reasons", a bit mask: 0x4 the power
    cap, 0x20 / 0x40 thermal slowdowns, 0x80 the power brake); empty on a CPU or without nvidia-smi. Whether a kernel
    runs at a lower clock than another is a reason for its time that no profile of its instructions shows. The
    samples of the sampler's first 0.2 s, before the launches, are dropped."""
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return {}
    sampler = subprocess.Popen(["nvidia-smi", "-i", smi_index(), f"--query-gpu=timestamp,{CLOCK_QUERY}",
                                "--format=csv,noheader,nounits", "-lms", "10"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        time.sleep(0.2)                             # nvidia-smi's start, then the launches
        start = datetime.now()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        stop = datetime.now()
    finally:
        sampler.terminate()
    lines = sampler.communicate()[0].splitlines()
    return median_clocks("\n".join(line.split(",", 1)[1] for line in lines
                                   if "," in line and _sampled_between(line.split(",", 1)[0], start, stop)))


def _sampled_between(stamp: str, start: datetime, stop: datetime) -> bool:
    """Whether nvidia-smi's timestamp ("2026/12/04 20:51:03.123") lies in [start, stop] (local time, as both are)."""
    try:
        return start <= datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f") <= stop
    except ValueError:
        return False


def median_clocks(samples: str) -> dict[str, float]:
    """nvidia-smi's lines of CLOCK_FIELDS -> each field's median under its name ({"sm_mhz", "power_w", "gpu_c",
    "memory_c"}) and the most frequent reasons mask ("clock_reasons"), each from the values it could read (a field
    nvidia-smi answers "[N/A]" for, as some GPUs do for their memory's temperature, is left out); empty without
    one."""
    values = {name: [] for name in CLOCK_FIELDS.values()}
    for line in samples.splitlines():
        fields = line.split(",")
        if len(fields) != len(values):
            continue
        for name, field in zip(values, fields):
            try:
                values[name].append(int(field, 16) if name == "clock_reasons" else float(field))
            except ValueError:
                continue
    return {name: statistics.mode(read) if name == "clock_reasons" else statistics.median(read)
            for name, read in values.items() if read}


@contextlib.contextmanager
def nvtx_range(name: str, device: str):
    """An NVTX push / pop range around the block on a GPU (nothing on the CPU, which has no NVTX)."""
    if device != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def paged_half(q: torch.Tensor, kv, splits: int, maxnreg: int, half: str, times: torch.Tensor | None = None,
               pad: tuple[str, int] | None = None, waits: bool = False, kernel: str = "gluon-tma"):
    """A call of a Gluon kernel's paged launch (`kernel`, one with TMA copies) that only copies its pages and waits
    for them (half "copies", decode_gluon's COMPUTE=False: what the memory pipeline alone takes) or only computes,
    over its first slot's pages again and again ("arithmetic", COPIES=False: what the instructions alone take), or
    does both ("whole": the paged launch alone, without the remaining blocks and the merge); times: each program's
    start, end and multiprocessor, with waits also its cycles waiting for pages (decode_gluon's WAITS); pad:
    decode_gluon.launch's (instructions added that change nothing)."""
    from kernels import decode_gluon
    b, hq, d = q.shape
    parts = (torch.empty(b, hq, splits, d, device=q.device), torch.empty(b, hq, splits, device=q.device),
             torch.empty(b, hq, splits, device=q.device))
    descriptors = decode_gluon.tma_descriptors(kv, d)
    options = decode_gluon.kernel_options(kernel)
    if not options["use_tma"]:
        raise ValueError(f"paged_half takes a TMA kernel, not {kernel!r}")
    return lambda: decode_gluon.launch(q, kv, 1.0, parts, splits, maxnreg, descriptors=descriptors,
                                       compute=half != "copies", copies=half != "arithmetic", times=times,
                                       waits=waits, pad=pad, **options)


def timeline(times: torch.Tensor) -> dict:
    """A launch's programs from their (start ns, end ns, multiprocessor[, key wait, value wait, cycles]) rows: the
    launch's span, how long its programs took to start (the last start after the first) and to end (the last end
    after the first), each program's time (shortest, median, longest), the programs a multiprocessor held (fewest,
    most) and how many it ran at once on average over the span (its programs' time over the span), in µs where
    times; where the rows have cycles (decode_gluon's WAITS), the share of all programs' cycles spent waiting for key
    pages and for value pages, in %."""
    start, end, sm = times[:, 0].double() / 1e3, times[:, 1].double() / 1e3, times[:, 2]
    span = float(end.max() - start.min())
    took = end - start
    per_sm = torch.bincount(sm)
    used = per_sm[per_sm > 0]
    return {"span_us": span, "starts_us": float(start.max() - start.min()), "ends_us": float(end.max() - end.min()),
            "shortest_us": float(took.min()), "median_us": float(took.median()), "longest_us": float(took.max()),
            "fewest_a_sm": float(used.min()), "most_a_sm": float(used.max()),
            "at_once_a_sm": float(took.sum()) / span / len(used),
            **({"key_wait_pct": 100 * times[:, 3].sum().item() / times[:, 5].sum().item(),
                "value_wait_pct": 100 * times[:, 4].sum().item() / times[:, 5].sum().item()}
               if times.shape[1] > 5 and times[:, 5].sum() > 0 else {})}


def call_timeline(paged: torch.Tensor, remaining: torch.Tensor) -> dict:
    """A whole call's paged and remaining blocks' programs from their timeline rows (rows never written, past a
    launch's programs, are dropped), in µs from the paged launch's first start: the paged launch's span and how
    long its programs took to end (the last end after the first); the remaining blocks' programs' first start, how
    many of them started before the paged launch's last end (%), their median and longest times, and their last end
    after the paged launch's last end: the tail that they add to the paged launch (the merge comes after both)."""
    paged, remaining = paged[paged[:, 1] > 0], remaining[remaining[:, 1] > 0]
    origin = paged[:, 0].min()
    p_start, p_end = (paged[:, 0] - origin).double() / 1e3, (paged[:, 1] - origin).double() / 1e3
    r_start, r_end = (remaining[:, 0] - origin).double() / 1e3, (remaining[:, 1] - origin).double() / 1e3
    last = float(p_end.max())
    return {"paged_span_us": last, "paged_ends_us": last - float(p_end.min()),
            "rest_first_start_us": float(r_start.min()),
            "rest_started_before_paged_end_pct": 100 * float((r_start < last).double().mean()),
            "rest_median_us": float((r_end - r_start).median()), "rest_longest_us": float((r_end - r_start).max()),
            "tail_us": float(r_end.max()) - last}


def back_to_back(make_run, rows: int, device: str, launches: int = 8) -> dict:
    """One launch `launches` times in a row, eagerly and captured in one CUDA graph (as median_seconds times it),
    each writing its programs' times to a buffer of its own (make_run(times) -> the launch; rows: its programs):
    sequence() of both. Whether a graph replay's time per launch is a launch's own time: in session 29 the paged
    launch took 385.3 µs a launch in graph replays, while one eager launch's programs spanned 408.8 µs."""
    if device != "cuda":
        return {}
    result = {}
    for mode in ("eager", "graph"):
        buffers = [torch.zeros(rows, TIMES_ROW.value, dtype=torch.int64, device=device) for _ in range(launches)]
        runs = [make_run(times) for times in buffers]
        if mode == "eager":
            for run in runs:
                run()
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for run in runs:
                    run()
            graph.replay()
        torch.cuda.synchronize()
        result[mode] = sequence([times.cpu() for times in buffers])
    return result


def sequence(launches: list[torch.Tensor]) -> dict:
    """Launches in a row from their programs' (start ns, end ns, ...) rows: each launch's span (its first start to
    its last end) and the gap from each launch's last end to the next one's first start (negative where the next
    began before this one ended), in µs: shortest, median and longest of each."""
    starts = torch.stack([t[:, 0].min() for t in launches]).double() / 1e3
    ends = torch.stack([t[:, 1].max() for t in launches]).double() / 1e3
    spans, gaps = ends - starts, starts[1:] - ends[:-1]
    return {f"{name}_{stat}_us": float(getattr(x, stat)()) for name, x in (("span", spans), ("gap", gaps))
            for stat in ("min", "median", "max")}


def paged_bytes(kv) -> int:
    """Bytes of the pages the paged kernel reads: every sequence's slots with both a key and a value page."""
    h, d = kv.k_fp.shape[1], kv.k_fp.shape[3]
    page = key_page_bytes(h, d, kv.page_size, kv.n_boost) + value_page_bytes(h, d, kv.page_size, kv.v_bits)
    return int(torch.minimum(kv.n_kpages, kv.n_vpages).sum()) * page


def print_rows(rows, header=True):
    if header:
        print(f"{'B':>3} {'L':>6} {'method':>20} {'us':>10} {'rest / paged / merge us':>24} {'GB/s':>8} "
              f"{'vs SDPA':>8} {'max|err|':>9}")
    for r in rows:
        err = "" if r.get("max_err") is None else f"{r['max_err']:.3g}"
        parts = "" if r.get("paged_us") is None else \
            f"{r['remaining_us']:.1f} / {r['paged_us']:.1f} / {r['merge_us']:.1f}"
        print(f"{r['batch']:>3} {r['tokens']:>6} {r['method']:>20} {r['us']:>10.1f} {parts:>24} {r['gbs']:>8.0f} "
              f"{r['vs_sdpa']:>7.2f}x {err:>9}", flush=True)


# ---------------------------------------------------------------------------------------------- generate
def build_model(quick: bool):
    import transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = QWEN3_8B if not quick else dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, max_position_embeddings=4096)
    config = transformers.Qwen3Config(**shape, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None       # random weights: generate every asked-for token
    model.generation_config.pad_token_id = 0
    return model


def kv_bytes_per_sequence(method: str, model, tokens: int, flush_spread: int = 1) -> float:
    """The cache's bytes for one sequence of `tokens` tokens, from the layout (what sizes the batch). A Kitty cache
    made to reserve room for them allocates its buffers at capacity and every page up front: those bytes."""
    cfg = model.config
    layers, h, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    elem = 2 if model.dtype != torch.float32 else 4
    if method in ("hf-dynamic", "hf-static"):
        return layers * 2 * tokens * h * d * elem
    if method.startswith("hf-quanto"):
        bits = int(method[-1])
        return layers * 2 * h * (tokens * d * bits / 8 + tokens * 4 + 128 * d * elem)   # + fp16 residual
    return memory.sequence_bytes(method_config(method), cfg, tokens, reserved=True, flush_spread=flush_spread)


def requantize_bytes_per_sequence(method: str, model, tokens: int) -> float:
    """What transformers' QuantizedCache (quanto) allocates beside its cache for one sequence whose layer holds
    `tokens` tokens, one layer at a time, at a step that requantizes (every 128 tokens, and every prefill chunk):
    QuantizedLayer.update keeps the dequantized keys and values and their concatenations with the residual alive
    (4 copies in the model dtype) while quanto quantizes one of them (about two temporaries in the model dtype and
    its unpacked codes, one byte per element: the 32 MiB per sequence that ran out at 32K in session 7). Nothing
    for other methods."""
    if not method.startswith("hf-quanto"):
        return 0.0
    cfg = model.config
    elem = 2 if model.dtype != torch.float32 else 4
    return tokens * cfg.num_key_value_heads * cfg.head_dim * (6 * elem + 1)


def decode_workspace_bytes(method: str, model, flush_spread: int = 1,
                           sm_count: int = 132) -> tuple[float, float]:
    """(fixed bytes, bytes per sequence) of the Kitty decode kernel's per-layer workspace (DecodeWorkspace): float32
    partials (output, max, sum) of each query head for the programs over the paged blocks (default_splits: at most
    one wave of them in all once the batch is large, else one per sequence and KV head) and for the remaining
    blocks (decode_rest.rest_blocks: sink, buffers), plus the output. Nothing for transformers' caches."""
    if method.startswith("hf-"):
        return 0.0, 0.0
    cfg, cache = model.config, method_config(method)
    layers, h, hq, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    elem = 2 if model.dtype != torch.float32 else 4
    g = cache.page_size
    remaining = rest_blocks(g, cache.sink, cache.sink + cache.local_window + g + flush_spread - 1)
    part = hq * (d + 2) * 4
    wave = resident_programs(MAXNREG) * sm_count
    return layers * part * wave / h, layers * (part * (remaining + 1) + hq * d * elem)


def static_keys_repeated() -> bool:
    """Whether this transformers copies a static cache's keys and values to every query head in each forward:
    5.17 (the H200's) does, for the prompt and every decode step (SDPA with a mask, repeat_kv); 5.23 reads them in
    place (a causal prompt without a mask, decode steps with the query heads packed: pack_gqa)."""
    from transformers.integrations import sdpa_attention
    return not hasattr(sdpa_attention, "pack_gqa")


def prefill_bytes_per_sequence(method: str, model, prompt: int, chunk: int | None, cache_tokens: int) -> float:
    """What one sequence needs beside its cache while its prompt goes through the model, `chunk` tokens per forward
    (None: the whole prompt at once); the largest of the chunks is the last, whose cache holds prompt - chunk tokens.
    cache_tokens: the positions the cache is made for (a static cache's keys span all of them)."""
    cfg = model.config
    h, hq, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    elem = 2 if model.dtype != torch.float32 else 4
    n = min(chunk or prompt, prompt)                              # tokens of one forward
    # MLP activations (gate, up, product) and hidden states of one forward's tokens, the last token's float32 logits
    need = n * (3 * cfg.intermediate_size + 4 * cfg.hidden_size) * 2 + cfg.vocab_size * 8
    if n < prompt:                                                # chunks (one pass: no mask, SDPA's is_causal)
        need += n * prompt                    # transformers' bool mask (B, 1, n, cached + n), built once per forward
        if method.startswith("hf-"):
            # per layer: the cache's torch.cat of its keys and values, transformers' SDPA with a mask expanding them
            # to the HQ query heads (repeat_kv) and the mask made additive in the model dtype
            need += 2 * prompt * (h + hq) * d * elem + n * prompt * elem
        else:
            # per layer, KittyLayer._attend_chunk: dense keys and values of [cached | chunk] in the model dtype, the
            # output (n, HQ, D) beside SDPA's; SDPA runs flash attention (lower-right causal, no mask, no scores)
            need += 2 * prompt * h * d * elem + 2 * n * hq * d * elem
    if method == "hf-static" and static_keys_repeated():
        # a static cache's keys are all cache_tokens positions, so a one-pass prompt has a mask (B, 1, n,
        # cache_tokens), bool then additive, and it and every decode step take repeat_kv's copies of all of them at
        # the HQ heads, a layer at a time, while the MLP's activations are not live. At 512 + 8,192 tokens the plan
        # without this was 46 sequences and ran out of memory on the H200; 41 ran, with a decode peak of 75.0 GB:
        # weights and 41 times a cache and one such copy make 74.9 (BENCHMARKS.md section 2, session 13)
        copy = 2 * cache_tokens * hq * d * elem
        prompt_pass = n * 4 * cfg.hidden_size * 2 + cfg.vocab_size * 8 + n * cache_tokens * (1 + elem) + copy
        need = max(need, copy if n < prompt else prompt_pass)
    return need


def make_peer_cache(method, model, batch, max_len, flush_spread=1, flush="auto", decode_kernel="auto"):
    from transformers.cache_utils import DynamicCache, QuantizedCache, StaticCache

    from backend import make_cache
    if method == "hf-dynamic":
        return DynamicCache(config=model.config)
    if method == "hf-static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    if method.startswith("hf-quanto"):
        return QuantizedCache(backend="quanto", config=model.config, nbits=int(method[-1]), residual_length=128)
    return make_cache(model, method, record_magnitudes=False, reserve_tokens=max_len, flush_spread=flush_spread,
                      flush=flush, decode_kernel=decode_kernel)


class StepClock:
    """A stopping criterion that never stops: it timestamps every generated token (after a device sync), and on a
    GPU keeps the prefill's peak memory apart from the decode steps' (prefill_peak_gb; the allocator's peak is reset
    at the first token)."""

    def __init__(self):
        self.stamps = []
        self.prefill_peak_gb = None

    def __call__(self, input_ids, scores, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if not self.stamps:
                self.prefill_peak_gb = torch.cuda.max_memory_allocated() / 1e9
                torch.cuda.reset_peak_memory_stats()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def page_boundary_steps(method: str, prompt: int, steps: int, flush_spread: int = 1) -> np.ndarray:
    """Which decode steps make pages. Step i stores token prompt + i; it completes a key Q-buffer (a page is made
    after its attention) when (prompt + i + 1 - sink) % page_size == 0, and with flush_spread k the pages are made
    over that step and the k - 1 after it. All False for methods without pages."""
    flags = np.zeros(steps, dtype=bool)
    if method.startswith("hf-") or method == "fp16":
        return flags
    cfg = method_config(method)
    i = np.arange(steps)
    full = ((prompt + i + 1 - cfg.sink) % cfg.page_size == 0) & (prompt + i + 1 > cfg.sink)
    for late in range(flush_spread):
        flags[late:] |= full[:steps - late]
    return flags


# The page-boundary bar compares a step with the steps around it: over 8,192 generated tokens a step grows about 2x
# with its context, so the slowest late step is far above the whole run's median whatever the boundaries cost
NEIGHBOURS = 64


def local_spikes(steps: np.ndarray, boundary: np.ndarray, neighbours: int = NEIGHBOURS) -> np.ndarray:
    """Each page-boundary step's time over the median of the ordinary steps (not boundary ones) within `neighbours`
    steps before and after it: how much a page boundary costs where it happens. Steps 0-1 (an eager step and a CUDA
    graph's capture) are neither measured nor neighbours."""
    ordinary = ~boundary
    ordinary[:2] = False
    ratios = []
    for i in np.flatnonzero(boundary):
        if i < 2:
            continue
        lo, hi = max(0, i - neighbours), min(len(steps), i + neighbours + 1)
        near = steps[lo:hi][ordinary[lo:hi]]
        if len(near):
            ratios.append(steps[i] / np.median(near))
    return np.array(ratios)


def run_generate(model, method, batch, prompt, new_tokens, flush_spread=1, prefill_chunk=None, cuda_graphs=False,
                 flush="auto", cache_tokens=None, cached=0, decode_kernel="auto"):
    """One timed model.generate; cuda_graphs: replay decode steps as CUDA graphs (backend.graphs) where the cache
    allows it (Kitty caches with both sides quantized, on a GPU); flush: how Kitty caches make pages (make_cache);
    cache_tokens: the tokens the cache is made for (default cached + prompt + new_tokens); cached: tokens put into
    the cache first, untimed, by forwards of `prompt` tokens, so that the timed generate's prompt and decode steps
    come after them (a later context of a long generation: sampled_generate); decode_kernel: a Kitty cache's
    (make_cache)."""
    from transformers import StoppingCriteriaList
    device = model.device
    ids = torch.randint(100, model.config.vocab_size, (batch, cached + prompt), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    cache = make_peer_cache(method, model, batch, cache_tokens or cached + prompt + new_tokens, flush_spread, flush,
                            decode_kernel)
    with torch.no_grad():
        for first in range(0, cached, prompt):
            model(input_ids=ids[:, first:min(first + prompt, cached)], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    clock = StepClock()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    graphs = CudaGraphDecoding(model) if cuda_graphs else contextlib.nullcontext()
    start = time.perf_counter()
    with graphs:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, disable_compile=True,
                             prefill_chunk_size=prefill_chunk, stopping_criteria=StoppingCriteriaList([clock]))
    total = time.perf_counter() - start
    assert out.shape == (batch, cached + prompt + new_tokens)
    steps = np.diff(np.array(clock.stamps)) * 1e3                  # decode step latencies, ms
    ttft = clock.stamps[0] - start
    quantized = not method.startswith("hf-") and method != "fp16"
    row = dict(method=method, decode_kernel=decode_kernel, batch=batch, prompt=prompt, prefill_chunk=prefill_chunk,
               new_tokens=new_tokens, seconds=total, tokens_per_s=batch * new_tokens / total,
               decode_tokens_per_s=batch * (new_tokens - 1) / steps.sum() * 1e3, ttft_ms=ttft * 1e3,
               p50_ms=float(np.median(steps)), p99_ms=float(np.percentile(steps, 99)), max_ms=float(steps.max()),
               # the slowest step after the first two, an eager one and, with CUDA graphs, the capture
               # (backend.graphs; max_ms was 210-296 ms in the H200's 512-token runs, BENCHMARKS.md section 2,
               # session 14): the steps the page-boundary bar is about
               max_steady_ms=float(steps[2:].max()) if len(steps) > 2 else None,
               cuda_graphs=dict(captures=graphs.captures, replays=graphs.replays, disabled=graphs.disabled)
               if cuda_graphs else None,
               peak_gb=max(clock.prefill_peak_gb, torch.cuda.max_memory_allocated() / 1e9)
               if torch.cuda.is_available() else None,
               prefill_peak_gb=clock.prefill_peak_gb,
               decode_peak_gb=torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None)
    if quantized:
        boundary = page_boundary_steps(method, cached + prompt, len(steps), flush_spread)
        row["flush_spread"], row["flush"] = flush_spread, flush
        median = np.median(steps[~boundary])
        row["flush_steps_ms"] = float(np.mean(steps[boundary])) if boundary.any() else None
        row["flush_steps_p50_ms"] = float(np.median(steps[boundary])) if boundary.any() else None
        row["flush_steps_max_ms"] = float(np.max(steps[boundary])) if boundary.any() else None
        row["flush_overhead_pct"] = float(100 * np.clip(steps[boundary] - median, 0, None).sum() / steps.sum())
        spikes = local_spikes(steps, boundary)
        row["flush_local_p50"] = float(np.median(spikes)) if len(spikes) else None
        row["flush_local_max"] = float(spikes.max()) if len(spikes) else None
    return row


def bench_generate(args) -> dict:
    # The batch fills the budget: cached blocks of the prefill's large transients must be reusable by the cache's
    # later allocations, or the allocator's fragmentation, not the cache, decides the batch (set before CUDA starts)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    model = build_model(args.quick)
    prompt = args.prompt or (512 if not args.quick else 40)
    new_tokens = args.new_tokens or (8192 if not args.quick else 8)
    methods = args.methods or ["hf-dynamic", "hf-static", "hf-quanto4", "hf-quanto2", "kitty-pro", "kitty"]
    rows = []
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * 1e9 / total))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = args.budget_gb * 1e9 - weights - 2e9

    def plan(method, spread):
        """The largest batch whose caches, transients and decode workspace fit the budget."""
        ws_fixed, ws_per_seq = decode_workspace_bytes(method, model, spread, multiprocessors(torch.device("cuda")))
        per_seq = (kv_bytes_per_sequence(method, model, prompt + new_tokens, spread)
                   + prefill_bytes_per_sequence(method, model, prompt, args.prefill_chunk, prompt + new_tokens)
                   + ws_per_seq + requantize_bytes_per_sequence(method, model, prompt + new_tokens))
        return max(1, int((budget - ws_fixed) / per_seq))

    # each Kitty method with each --kernels decode kernel (its plan is the same: the kernel changes no memory)
    runs = [(method, kernel) for method in methods
            for kernel in (["auto"] if method.startswith("hf-") else args.kernels)]
    for method, kernel in runs:
        # Kitty caches replay their decode steps as CUDA graphs on a GPU unless --eager; transformers' caches run
        # as generate runs them (eager, disable_compile)
        graphed = torch.cuda.is_available() and not args.eager and not method.startswith("hf-") \
            and method_config(method).k_bits < 16 and method_config(method).v_bits < 16
        # --flush-spread auto: the spread of the planned batch (auto_flush_spread), and the plan again with the
        # room its waiting tokens take
        spread = 1 if args.flush_spread == "auto" else args.flush_spread
        batch = args.batch or (plan(method, spread) if torch.cuda.is_available() else 2)
        if args.flush_spread == "auto":
            spread = auto_flush_spread(batch)
            if torch.cuda.is_available() and not args.batch:
                batch = plan(method, spread)
        planned = batch
        row = dict(method=method, decode_kernel=kernel, batch=batch, prefill_chunk=args.prefill_chunk,
                   error="out of memory")
        for attempt in range(4):                      # the layout's estimate, confirmed by really running it
            try:
                if attempt == 0:                      # warm-up: kernel compilation stays out of the timings
                    # (on a GPU past a page boundary, where a Kitty cache's page-making kernels compile; with the
                    # run's flush_spread, which the fused kernels take as a compile-time constant: a warm-up without
                    # it left a 2.7 s compile in a timed page-boundary step, BENCHMARKS.md section 2)
                    warm_tokens = method_config(method).page_size + 1 if torch.cuda.is_available() \
                        and not method.startswith("hf-") else 4
                    run_generate(model, method, 1, prompt, warm_tokens, spread, args.prefill_chunk,
                                 cuda_graphs=graphed, flush=args.flush, decode_kernel=kernel)
                if args.sample_contexts:
                    row = sampled_generate(model, method, batch, prompt, new_tokens, args, graphed, spread, kernel)
                else:
                    row = run_generate(model, method, batch, prompt, new_tokens, spread,
                                       args.prefill_chunk, graphed, args.flush, decode_kernel=kernel)
                # how true the plan was: the batch it predicted and how many smaller tries it took
                row.update(planned_batch=planned, oom_retries=attempt)
                break
            except torch.OutOfMemoryError as exc:          # the allocator's own account: used, cached, asked
                print(f"  {method} at batch {batch}: {str(exc).splitlines()[0][:700]}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
                batch = int(batch * 0.9)
            except ImportError as exc:                # a peer whose package is missing (optimum-quanto)
                row = dict(method=method, decode_kernel=kernel, batch=batch, prefill_chunk=args.prefill_chunk,
                           error=str(exc).split(".")[0])
                break
        rows.append(row)
        print(json.dumps(row), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"kind": "generate", "budget_gb": args.budget_gb, "prefill_chunk": args.prefill_chunk,
            "model": "Qwen3-8B shape, random weights", "rows": rows, "env": environment()}


def sampled_generate(model, method, batch, prompt, new_tokens, args, graphed, flush_spread=1,
                     decode_kernel="auto") -> dict:
    """A generation too long to run whole (HF caches at 512 + 8,192 tokens need more than a 10-minute device
    call), estimated from measured pieces: `--sample-contexts N` runs of `--sample-steps` decode steps each, at N
    contexts from the prompt to the last token, the batch and the cache made for the whole generation (so memory
    and a static cache's length are the real run's). The decode time is the integral of the median step time over
    the contexts (piecewise linear between the samples); tokens/s counts the first run's prefill (the real prompt)
    and that decode time (flat past the first and last samples' middles). Page-boundary steps are in no median: for
    Kitty caches they cost under 1 % of decode time (BENCHMARKS.md section 2).
    A later context's cache is filled first (run_generate's `cached`), then its run prefills the prompt on top of
    it. That prefill attends over the whole context, a transient the real generation never has, so on a GPU those
    runs may use all of its memory (the memory cap is lifted for them); the row's peak is the first run's prefill
    and every run's decode steps (decode_peak_gb: under the budget if the plan is right)."""
    steps = args.sample_steps
    contexts = np.linspace(prompt, prompt + new_tokens - steps, args.sample_contexts).round().astype(int)
    samples = []
    for context in contexts:
        lift = torch.cuda.is_available() and context > prompt
        if lift:
            capped = args.budget_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(1.0)
        try:
            run = run_generate(model, method, batch, prompt, steps, flush_spread, args.prefill_chunk, graphed,
                               args.flush, cache_tokens=prompt + new_tokens, cached=int(context) - prompt,
                               decode_kernel=decode_kernel)
        finally:
            if lift:
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(min(1.0, capped))
        samples.append(dict(context=int(context), p50_ms=run["p50_ms"], ttft_ms=run["ttft_ms"],
                            prefill_peak_gb=run["prefill_peak_gb"], decode_peak_gb=run["decode_peak_gb"]))
    medians = np.array([x["p50_ms"] for x in samples])
    # a run's median step is the step in the middle of its contexts
    decode_s = float(np.interp(np.arange(prompt, prompt + new_tokens - 1), contexts + (steps - 1) / 2,
                               medians).sum()) / 1e3
    ttft_s = samples[0]["ttft_ms"] / 1e3
    return dict(method=method, decode_kernel=decode_kernel, batch=batch, prompt=prompt,
                prefill_chunk=args.prefill_chunk, new_tokens=new_tokens, estimated=True, samples=samples,
                seconds=ttft_s + decode_s,
                tokens_per_s=batch * new_tokens / (ttft_s + decode_s),
                decode_tokens_per_s=batch * (new_tokens - 1) / decode_s, ttft_ms=ttft_s * 1e3,
                p50_ms=float(np.median(medians)),
                peak_gb=max([samples[0]["prefill_peak_gb"] or 0] + [x["decode_peak_gb"] or 0 for x in samples])
                or None)


def ragged_prompt(batch: int, prompt: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded first turn whose sequences all differ in length: sequence b has prompt - b * prompt // (2 *
    batch) real tokens (from the whole prompt down to about half of it). Returns ids and the attention mask."""
    real = prompt - np.arange(batch) * prompt // (2 * batch)
    ids = torch.randint(100, vocab, (batch, prompt), device=device, generator=torch.Generator(device=device).manual_seed(2))
    mask = (torch.arange(prompt, device=device)[None, :] >= torch.as_tensor(prompt - real, device=device)[:, None])
    return ids, mask.long()


def run_turn(model, method, batch, prompt, turn, profile=False):
    """A chat's next turn on a filled cache: a ragged, left-padded first turn of up to `prompt` tokens, then
    `turn` new tokens for every sequence in one forward, the one timed. Returns the timed forward's row.
    profile: run the timed forward under torch.profiler and print its 20 costliest operations (GPU time)."""
    device = model.device
    ids, mask = ragged_prompt(batch, prompt, model.config.vocab_size, device)
    cache = make_peer_cache(method, model, batch, prompt + turn)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, logits_to_keep=1)
        ids2 = torch.randint(100, model.config.vocab_size, (batch, turn), device=device,
                             generator=torch.Generator(device=device).manual_seed(3))
        mask2 = torch.cat([mask, torch.ones_like(ids2)], dim=1)
        positions2 = positions[:, -1:] + 1 + torch.arange(turn, device=device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        profiler = torch.profiler.profile() if profile else contextlib.nullcontext()
        start = time.perf_counter()
        with profiler:
            model(input_ids=ids2, attention_mask=mask2, position_ids=positions2, past_key_values=cache,
                  logits_to_keep=1)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    if profile:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(f"{method}: the profiled turn\n" + profiler.key_averages().table(sort_by=sort, row_limit=20), flush=True)
    lengths = mask.sum(-1).tolist()
    return dict(method=method, batch=batch, prompt=prompt, turn=turn, first_turn_lengths=[min(lengths), max(lengths)],
                distinct_lengths=len(set(lengths)), ms=seconds * 1e3, tokens_per_s=batch * turn / seconds,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None)


def chunk_attention_rows(batch: int, prompt: int, turn: int) -> list[dict]:
    """One layer's chunk attention alone (kernels/chunk_attention.py, Qwen3-8B attention shape, bf16, the turn's
    ragged lengths), by the Triton kernel and by the PyTorch path (SDPA per distinct length): eager launches
    (do_bench), as a forward runs them; the kernel's largest difference from the PyTorch path beside it."""
    from kernels.chunk_attention import chunk_attention
    _, mask = ragged_prompt(batch, prompt, 1000, "cpu")
    past = mask.sum(-1).numpy()
    gen = torch.Generator(device="cuda").manual_seed(4)
    query = torch.randn(batch, 32, turn, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    keys, values = (torch.randn(batch, prompt + turn, 8, 128, device="cuda", dtype=torch.bfloat16,
                                generator=gen).transpose(1, 2) for _ in range(2))
    counts = np.full(batch, turn)
    # the kernel's output first, kept, so that its memory cannot be a block the PyTorch path's output left behind
    kernel_out = chunk_attention(query, keys, values, past, counts, 0.088, use_triton=True).float()
    reference = chunk_attention(query, keys, values, past, counts, 0.088, use_triton=False).float()
    rows = []
    for use_triton in (True, False):
        run = lambda: chunk_attention(query, keys, values, past, counts, 0.088, use_triton)  # noqa: E731
        err = ((kernel_out if use_triton else run().float()) - reference).abs().max().item()
        ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
        rows.append(dict(method=f"chunk-attention (one layer, {'triton' if use_triton else 'sdpa per length'})",
                         batch=batch, prompt=prompt, turn=turn, distinct_lengths=len(set(past.tolist())), ms=ms,
                         tokens_per_s=batch * turn / ms * 1e3, max_err=err, repeat=0))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_turn(args) -> dict:
    """The next turn of a chat on a ragged batch: every sequence's cache holds a first turn of its own length, and
    `--new-tokens` more prompt tokens go through the model in one forward (Kitty caches: KittyLayer._attend_chunk;
    transformers' DynamicCache: its concatenated keys and SDPA with a mask)."""
    model = build_model(args.quick)
    prompt = args.prompt or (8192 if not args.quick else 300)
    turn = args.new_tokens or (256 if not args.quick else 12)
    batch = args.batch or (16 if not args.quick else 3)
    methods = args.methods or ["hf-dynamic", "kitty-pro", "kitty"]
    rows = []
    for method in methods:
        run_turn(model, method, 2, min(prompt, 300), turn)             # warm-up: kernel compilation stays out
        for repeat in range(args.repeat):
            row = dict(run_turn(model, method, batch, prompt, turn), repeat=repeat)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.profile:                  # one more forward, under the profiler (its time is not a row)
            run_turn(model, method, batch, prompt, turn, profile=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if torch.cuda.is_available():
        rows.extend(chunk_attention_rows(batch, prompt, turn))
    return {"kind": "turn", "model": "Qwen3-8B shape, random weights" if not args.quick else "tiny random",
            "rows": rows, "env": environment()}


# ---------------------------------------------------------------------------------------------- figures
SYSTEM_BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def png_browser() -> str | None:
    """The Chrome/Chromium kaleido renders PNGs with: $BROWSER_PATH, else the first of SYSTEM_BROWSERS.

    kaleido 1.x starts the browser through choreographer, which takes $BROWSER_PATH before its own PATH search
    (choreographer/utils/_which.py) and already passes --headless --no-sandbox, so running as root needs nothing
    more. Never downloads a browser."""
    if not os.environ.get("BROWSER_PATH"):
        found = next((path for path in SYSTEM_BROWSERS if os.access(path, os.X_OK)), None)
        if found is None:
            return None
        os.environ["BROWSER_PATH"] = found
    return os.environ["BROWSER_PATH"]


# ---------------------------------------------------------------------------------------------- compare
COMPARE_PROMPT = "Explain in two sentences why the sky is blue."


def bench_compare(args) -> dict:
    """The page's comparison on the default model, timed as a visitor sees it, `--repeat` times."""
    from .engine import GenerationSettings, prepare_comparison, resolve_methods
    from .model import load_model
    model, tokenizer = load_model()
    methods = resolve_methods(args.methods or ["fp16", "kivi-k2v2", "kitty"])
    settings = GenerationSettings(max_new_tokens=args.new_tokens or 64)
    rows = []
    for repeat in range(args.repeat):
        comparison = prepare_comparison(model, tokenizer, [{"role": "user", "content": COMPARE_PROMPT}], methods,
                                        settings)
        start, answered = time.perf_counter(), None
        comparison.start()
        while not comparison.finished:
            if answered is None and all(s.finished for s in comparison.snapshots().values()):
                answered = time.perf_counter() - start
            time.sleep(0.01)
        total = time.perf_counter() - start
        snaps = comparison.snapshots()
        rows.append({"repeat": repeat, "answers_s": answered or total, "with_scoring_s": total,
                     "tokens_per_s": {m: s.tokens_per_s for m, s in snaps.items()},
                     "tokens": {m: len(s.token_ids) for m, s in snaps.items()}})
        print(f"answers complete {rows[-1]['answers_s']:.2f} s, scored {total:.2f} s, tokens/s "
              + ", ".join(f"{m} {v:.1f}" for m, v in rows[-1]["tokens_per_s"].items() if v), flush=True)
    return {"kind": "compare", "prompt": COMPARE_PROMPT, "model": model.kitty_model_name,
            "device": str(model.device), "rows": rows, "env": environment()}


def bench_quality(args) -> dict:
    """Teacher-forced KL from the full-precision model on the default model, for each method and decode kernel
    (test_quality's measure, as a table): what a kernel's arithmetic costs in accuracy beside what the cache's
    quantization costs. The 8-bit kernels are fed one token at a time (analysis.page_lengths), their arithmetic from
    kernels/i8_reference.py on a CPU; the others between page boundaries."""
    from . import make_cache
    from .analysis import bundled_text, mean_kl, page_lengths, perplexity, teacher_forced_logprobs
    from .model import load_model
    model, tokenizer = load_model()
    prefix = 16
    ids = tokenizer(bundled_text(), return_tensors="pt").input_ids[:, :args.prompt or 1040].to(model.device)
    with torch.no_grad():
        reference = model(ids).logits[0, prefix - 1:-1].float().log_softmax(-1).cpu()
    targets = ids[0, prefix:]
    rows = [{"method": "full precision", "kernel": None, "kl": 0.0, "perplexity": perplexity(reference, targets)}]
    for method in args.methods or ["kitty-pro", "kivi-k2v2"]:
        for kernel in args.kernels:
            cache = make_cache(model, method, decode_kernel=kernel)
            fed = "one token a step" if page_lengths(cache, prefix, ids.shape[1] - 1) is None else "page chunks"
            start = time.perf_counter()
            logprobs = teacher_forced_logprobs(model, ids, cache, prefix=prefix)
            rows.append({"method": method, "kernel": kernel, "fed": fed, "kl": mean_kl(reference, logprobs),
                         "perplexity": perplexity(logprobs, targets), "seconds": time.perf_counter() - start})
    print(f"teacher-forced over {ids.shape[1] - prefix} tokens of the bundled text, {model.kitty_model_name} on "
          f"{model.device}:")
    for row in rows:
        print(f"  {row['method']:>16} {row['kernel'] or '':>14}  KL {row['kl']:.4f}  perplexity "
              f"{row['perplexity']:.2f}" + (f"  ({row['fed']}, {row['seconds']:.0f} s)" if row["kernel"] else ""),
              flush=True)
    return {"kind": "quality", "tokens": ids.shape[1] - prefix, "model": model.kitty_model_name,
            "device": str(model.device), "rows": rows, "env": environment()}


def write_figures(result: dict, out: Path) -> list[Path]:
    """One Plotly figure per table: HTML always, PNG where kaleido is installed and a browser is found."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        print("plotly is not installed: no figures", file=sys.stderr)
        return []
    rows = [r for r in result["rows"] if "error" not in r]
    fig = go.Figure()
    if result["kind"] == "attention":
        for method in dict.fromkeys(r["method"] for r in rows):
            sel = [r for r in rows if r["method"] == method]
            fig.add_bar(name=method, x=[f"B={r['batch']} L={r['tokens']}" for r in sel], y=[r["us"] for r in sel])
        fig.update_layout(title="Decode attention, median time per call (lower is better)", yaxis_type="log",
                          yaxis_title="microseconds", barmode="group")
    elif result["kind"] == "compare":
        for key, name in (("answers_s", "answers complete"), ("with_scoring_s", "scored against FP16")):
            fig.add_bar(name=name, x=[f"run {r['repeat'] + 1}" for r in rows], y=[r[key] for r in rows])
        fig.update_layout(title=f"One comparison on {result['device']} ({', '.join(rows[0]['tokens'])})",
                          yaxis_title="seconds", barmode="group")
    elif result["kind"] == "tune":
        # one bar series per setting but the split count (the x axis), by every field a row holds: two settings
        # never share a series, whose bars at one x would stack
        keys = [k for k in TUNE_DEFAULTS if any(k in r for r in rows)]

        def setting_of(r):                   # hashable: a saved pad, (kind, count), comes back as a JSON list
            return tuple(tuple(v) if isinstance(v, list) else v for v in map(r.get, keys))

        for setting in dict.fromkeys(map(setting_of, rows)):
            sel = [r for r in rows if setting_of(r) == setting]
            fig.add_bar(name=", ".join(f"{k} {v}" for k, v in zip(keys, setting) if v not in (None, False)),
                        x=[f"{r['method']} B={r['batch']} L={r['tokens']} splits={r['splits']}" for r in sel],
                        y=[r["us"] for r in sel])
        fig.update_layout(title="Decode kernel launch settings, median time per call (lower is better)",
                          yaxis_type="log", yaxis_title="microseconds", barmode="group")
    elif result["kind"] == "turn":
        fig.add_bar(x=[f"{r['method']} (run {r['repeat'] + 1})" for r in rows], y=[r["ms"] for r in rows])
        r = rows[0]
        fig.update_layout(title=f"A chat's next turn of {r['turn']} tokens on {r['batch']} sequences of "
                                f"{r['first_turn_lengths'][0]}-{r['first_turn_lengths'][1]} tokens (lower is better)",
                          yaxis_title="milliseconds per forward")
    elif result["kind"] == "quality":
        cached = [r for r in rows if r["kernel"]]
        for kernel in dict.fromkeys(r["kernel"] for r in cached):
            sel = [r for r in cached if r["kernel"] == kernel]
            fig.add_bar(name=f"decode kernel {kernel}", x=[r["method"] for r in sel], y=[r["kl"] for r in sel])
        fig.update_layout(title=f"Teacher-forced KL from full precision over {result['tokens']} tokens, "
                                f"{result['model']} (lower is better)", yaxis_title="nats / token", barmode="group")
    else:
        fig.add_bar(x=[f"{r['method']}{'' if r.get('decode_kernel', 'auto') == 'auto' else '/' + r['decode_kernel']}"
                       f" (B={r['batch']})" for r in rows], y=[r["tokens_per_s"] for r in rows])
        fig.update_layout(title=f"Generation under a {result['budget_gb']} GB budget: tokens/s at the largest batch",
                          yaxis_title="tokens / s")
    paths = [out.with_suffix(".html")]
    fig.write_html(paths[0])
    if importlib.util.find_spec("kaleido") is None:
        print("PNG skipped: kaleido is not installed (pip install -r requirements.txt)", file=sys.stderr)
    elif png_browser() is None:
        print(f"PNG skipped: no Chrome/Chromium at {', '.join(SYSTEM_BROWSERS)} and BROWSER_PATH is unset "
              "(apt-get install chromium, or set BROWSER_PATH)", file=sys.stderr)
    else:
        try:
            fig.write_image(out.with_suffix(".png"), width=1100, height=550)
            paths.append(out.with_suffix(".png"))
        except Exception as exc:                      # e.g. BROWSER_PATH names no browser, or it fails to start
            first = (str(exc).strip().splitlines() or [""])[0]
            print(f"PNG skipped (BROWSER_PATH={os.environ['BROWSER_PATH']}): {type(exc).__name__}: {first}",
                  file=sys.stderr)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["attention", "generate", "tune", "compare", "turn", "quality", "plot"])
    parser.add_argument("results", nargs="?", help="for plot: a results JSON written by --out")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, CPU friendly, under a minute")
    parser.add_argument("--out", type=Path, help="write results JSON here (and figures beside it)")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--lengths", type=int, nargs="*")
    parser.add_argument("--methods", nargs="*")
    parser.add_argument("--kernels", nargs="*", type=check_kernel, default=["auto"],
                        help=f"attention, quality, generate: decode kernels over the paged blocks, each measured: "
                             f"{', '.join(KERNELS)}, or a Gluon kernel with experiments (gluon-tma+zq-ahead ...: "
                             f"decode_attention.GLUON_EXPERIMENTS) (default: auto, the product's choice; gluon: GPU "
                             f"only, but the 8-bit kernels' arithmetic also runs on a CPU for quality; generate: each "
                             f"Kitty method with each)")
    parser.add_argument("--pdl", choices=list(PDL_CHOICES), default="default",
                        help="attention: decode_attention's pdl (its three launches chained by programmatic dependent "
                             "launch): its default, off, on or both, each measured")
    parser.add_argument("--budget-gb", type=float, default=80.0)
    parser.add_argument("--prompt", type=int, help="generate: prompt tokens; turn: the longest first turn; quality: "
                        "tokens of the bundled text (default 1,040)")
    parser.add_argument("--new-tokens", type=int, help="generate: tokens to generate; turn: the next turn's tokens")
    parser.add_argument("--batch", type=int, help="generate: force this batch instead of the largest that fits; "
                        "turn: the batch (default 16)")
    parser.add_argument("--repeat", type=int, default=2, help="compare, turn: how many times to time")
    parser.add_argument("--vary", nargs="*", choices=TUNE_SWEEPS, default=list(TUNE_SWEEPS),
                        help="tune: which settings to sweep around the default (each compiled anew: a minute or two)")
    parser.add_argument("--profile", action="store_true",
                        help="turn: profile one more forward per method (torch.profiler) and print its costliest "
                             "operations")
    parser.add_argument("--flush-spread", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="generate: quantize a batch's full buffers over this many steps (1: paper schedule; "
                             "auto, the caches' default: by batch size, backend.cache.auto_flush_spread)")
    parser.add_argument("--flush", choices=FLUSH_MODES, default="auto",
                        help="generate: how Kitty caches turn full buffers into pages at a page boundary ('fused': "
                             "one Triton kernel per kind, kernels/flush.py; 'auto': fused on a GPU)")
    parser.add_argument("--eager", action="store_true",
                        help="generate: no CUDA graphs for Kitty caches (by default their decode steps are replayed)")
    parser.add_argument("--sample-contexts", type=int, default=0, metavar="N",
                        help="generate: estimate each row from --sample-steps decode steps at N contexts between the "
                             "prompt and the last token (sampled_generate; for generations longer than a device call) "
                             "instead of running it whole")
    parser.add_argument("--sample-steps", type=int, default=16, help="generate: decode steps a sampled context times")
    parser.add_argument("--prefill-chunk", type=int,
                        help="generate: feed the prompt through the cache this many tokens at a time, every method "
                             "(generate's prefill_chunk_size; default: the whole prompt in one pass)")
    args = parser.parse_args(argv)
    if args.kind == "plot":
        result = json.loads(Path(args.results).read_text())
        for path in write_figures(result, Path(args.results)):
            print(path)
        return 0
    result = {"attention": bench_attention, "generate": bench_generate, "tune": bench_tune,
              "compare": bench_compare, "turn": bench_turn, "quality": bench_quality}[args.kind](args)
    if result.get("copy_gbs"):
        print(f"device-to-device copy: {result['copy_gbs']:.0f} GB/s (read + write)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        for path in write_figures(result, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
