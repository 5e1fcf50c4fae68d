"""Where a decode step's time goes: the host issuing work, or the GPU doing it.

    python -m backend.step_profile [--prompt 4096] [--batch 32] [--steps 160] [--methods hf-static kitty-pro]
                                   [--cuda-graphs] [--out profile.json] [--quick]

For each method, a Qwen3-8B-shaped model with random weights (backend.bench.build_model) prefills `batch`
prompts, then decodes `steps` tokens one model call at a time:
  - step_ms: wall time of a step, the device synchronized after it;
  - issue_ms: the host's time inside the model call before it returns (no synchronization): when it is close to
    step_ms, the GPU waits for Python (launch-bound) or the step synchronizes somewhere (then `syncs` says where);
  - gpu_ms: the summed duration of the step's GPU kernels, from torch.profiler over a few steps, and `kernels`,
    how many it launched;
each reported apart for ordinary steps and page-boundary steps (a key buffer becomes a page), with the host
operations that took the most time (self CPU time) in a profiled page-boundary step.

    python -m backend.step_profile --bookkeeping [--batch 192] [--prompt 512] [--steps 1024] [--methods kitty-pro]

measures on any machine what a replayed (CUDA-graph) decode step leaves to the host, the cache's own bookkeeping:
36 layers of a Kitty cache with the fused page-making path, whose two kernels per layer are replaced by nothing,
median host milliseconds of ordinary and page-boundary steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .bench import build_model, environment, make_peer_cache, page_boundary_steps
from .graphs import CudaGraphDecoding

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
               "aten::_local_scalar_dense", "aten::nonzero", "cudaMemcpy")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_method(model, method: str, batch: int, prompt: int, steps: int, profiled: int = 3,
                   cuda_graphs: bool = False) -> dict:
    """One method's decode steps (see the module's doc); cuda_graphs: replay them as CUDA graphs where the
    cache allows (backend.graphs; Kitty caches on a GPU)."""
    graphs = CudaGraphDecoding(model) if cuda_graphs else contextlib.nullcontext()
    with graphs:
        row = _profile(model, method, batch, prompt, steps, profiled)
    if cuda_graphs:
        row["cuda_graphs"] = dict(captures=graphs.captures, replays=graphs.replays, disabled=graphs.disabled)
    return row


def _profile(model, method: str, batch: int, prompt: int, steps: int, profiled: int) -> dict:
    device = model.device
    ids = torch.randint(100, model.config.vocab_size, (batch, prompt), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    cache = make_peer_cache(method, model, batch, prompt + steps + 8)
    mask = torch.ones((batch, prompt + steps + 8), dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        _sync()
        step_ms, issue_ms = [], []

        def step(i):
            length = prompt + i + 1
            position = torch.full((batch, 1), length - 1, device=device)
            return model(token, attention_mask=mask[:, :length], position_ids=position, past_key_values=cache,
                         use_cache=True).logits[:, -1:].argmax(-1)

        for i in range(steps):
            start = time.perf_counter()
            token = step(i)
            issued = time.perf_counter()
            _sync()
            step_ms.append((time.perf_counter() - start) * 1e3)
            issue_ms.append((issued - start) * 1e3)
        flush = page_boundary_steps(method, prompt, steps)
        row = dict(method=method, batch=batch, prompt=prompt, steps=steps)
        for name, sel in (("ordinary", ~flush), ("page_boundary", flush)):
            if sel.any():
                row[name] = dict(count=int(sel.sum()), step_ms=float(np.median(np.array(step_ms)[sel])),
                                 issue_ms=float(np.median(np.array(issue_ms)[sel])))
        for name, measured in _kernel_profile(step, prompt, steps, method, profiled).items():
            row.setdefault(name, {}).update(measured)
    del cache
    return row


def _kernel_profile(step, prompt, steps, method, profiled) -> dict:
    """GPU kernel time and launches of a few more ordinary steps and one page-boundary step (the cache goes on
    from `steps`), with the host operations of the latter."""
    from torch.profiler import ProfilerActivity, profile
    result = {}
    more = page_boundary_steps(method, prompt, steps + 256)[steps:]
    boundary = int(np.flatnonzero(more)[0]) if more.any() else None
    kinds = [("ordinary", [i for i in range(profiled) if not more[i]])]
    if boundary is not None:
        kinds.append(("page_boundary", [boundary]))
    done = 0
    for name, wanted in kinds:
        while done < min(wanted):                                   # advance the cache to the wanted step
            step(steps + done)
            done += 1
        _sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            for i in wanted:
                step(steps + i)
            _sync()
        done = max(wanted) + 1
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        n = len(wanted)
        entry = result.setdefault(name, {})
        entry.update(gpu_ms=gpu_us / 1e3 / n, kernels=kernels / n,
                     syncs={e.key: e.count // n for e in events if e.key in SYNC_EVENTS and e.count >= n})
        if name == "page_boundary" or boundary is None:
            top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
            entry["top_host_ops"] = [dict(op=e.key, calls=e.count // n, self_cpu_ms=e.self_cpu_time_total / 1e3 / n)
                                     for e in top]
    return result


def _no_kernel(*args, **kwargs) -> None:
    """Stands in for a page-making kernel launch (bookkeeping measures the host's work around it)."""


def bookkeeping(method: str, batch: int, prompt: int, steps: int, layers: int = 36) -> dict:
    """Host time of the cache's own work in replayed decode steps (KittyLayer.replayed_decode_step, flush="fused")
    with the page-making kernels left out: what a page-boundary step adds on the host whatever the GPU."""
    from unittest import mock

    from .cache import KittyLayer
    from .methods import method_config
    cfg = method_config(method)
    cache, shared_indices = [], {}                        # the layers share their index copies, as in KittyCache
    for i in range(layers):
        layer = KittyLayer(cfg, i, use_triton=False, record_magnitudes=False, reserve_tokens=prompt + steps,
                           flush="fused", shared_indices=shared_indices)
        k = torch.zeros(batch, 1, prompt, 64, dtype=torch.bfloat16)     # the sizes do not matter to the host
        layer.lazy_initialization(k, k)
        layer._append(k, k, np.full(batch, prompt))
        cache.append(layer)
    times = {True: [], False: []}
    # plain no-op functions, not MagicMocks: a mock's own call bookkeeping cost ~1 ms per page-boundary step here
    with mock.patch("kernels.flush.flush_key_pages", new=_no_kernel), \
            mock.patch("kernels.flush.flush_value_pages", new=_no_kernel):
        for _ in range(steps):
            ordinary = [layer.next_decode_is_ordinary() for layer in cache]
            start = time.perf_counter()
            for layer, plain in zip(cache, ordinary):
                layer.replayed_decode_step(plain)
            times[ordinary[0]].append((time.perf_counter() - start) * 1e3)
    return dict(method=method, batch=batch, prompt=prompt, layers=layers, steps=steps,
                ordinary_ms=float(np.median(times[True])), boundary_ms=float(np.median(times[False])),
                boundary_steps=len(times[False]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.step_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--methods", nargs="*", default=["hf-static", "kitty-pro"])
    parser.add_argument("--quick", action="store_true", help="tiny model (a CPU run of the tool itself)")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs where the "
                        "cache allows (Kitty caches on a GPU): each method is profiled both ways")
    parser.add_argument("--bookkeeping", action="store_true",
                        help="only the host side of replayed steps, page-making kernels left out (any machine)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    model = None if args.bookkeeping else build_model(args.quick)
    for method in args.methods:
        if args.bookkeeping:
            rows.append(bookkeeping(method, args.batch, args.prompt, args.steps))
            print(json.dumps(rows[-1]), flush=True)
            continue
        for graphed in (False, True) if args.cuda_graphs and not method.startswith("hf-") else (False,):
            row = profile_method(model, method, args.batch, args.prompt, args.steps, cuda_graphs=graphed)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"kind": "step_profile", "rows": rows,
                                        "env": environment("python -m backend.step_profile")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
