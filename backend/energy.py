"""Where a decode call's energy goes on the GPU: each part's joules a call above the idle GPU, and per byte.

    python -m backend.energy [--method kitty-pro] [--batch 64] [--length 32768] [--kernels K ...] [--out energy.json]

Why: on the H200 the kitty-pro call at batch 64 / 32K runs at the software power cap (BENCHMARKS.md section 1,
sessions 33 and 44), so its time is its energy over the power the cap leaves: T = E / (P_cap - P_idle), roughly.
What a change can buy is then a share of E, and this says how E splits. Each row is one launch (or call), timed as
the bench times it (median of CUDA-graph replays, bench.median_seconds) and then replayed back to back from a CUDA
graph for a few seconds while nvidia-smi samples the GPU's power, clock and temperatures (bench.gpu_clocks); its
energy a call is (power - idle power) x time, in mJ, and per byte it must read, in pJ:
  - idle: the GPU with nothing launched (the baseline of every other row);
  - sdpa: torch SDPA over FP16 K/V of the same shape (the bar's baseline, a streaming read);
  - copy: a device-to-device copy of as many bytes as the pages (read + write, counted as both);
  - copies / arithmetic / whole: the paged launch's TMA copies and waits alone, its products alone (over its
    first pages again and again), and both (bench.paged_half, the kernel "auto" takes for this shape);
  - call: decode_attention's three launches (paged, remaining blocks, merge), as the product runs them, and
    call-nopdl the same launched one after another (no programmatic dependent launch);
  - remaining / merge: the call's other two launches alone (per byte: over the bytes the pages do not hold);
  - with --kernels, each one's arithmetic alone, whole paged launch and call (gluon-tma-i8, the plain gluon-tma ...);
  - whole-again: the whole paged launch once more, last (how much the GPU's warming moves a reading).
Readings come from nvidia-smi's power sensor (tens of ms), so each row is an average over its run, and two rows
compare only within one run on one machine. GPU only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kernels.decode_attention import (GLUON_MAXNREG, DecodeWorkspace, check_kernel, choose_kernel, decode_launches,
                                      gluon_maxnreg, is_gluon, split_count)

from .bench import (bytes_read, environment, filled_layer, gpu_clocks, median_seconds, paged_bytes, paged_half,
                    random_kv)

SAMPLE_SECONDS = 2.0                # back-to-back launches a row, while nvidia-smi samples power every 10 ms
GRAPH_CALLS = 20                    # a row's calls in the CUDA graph that its power run replays


def graphed(fn, calls: int = GRAPH_CALLS):
    """A callable that replays `calls` of fn captured in one CUDA graph: so that a row's power run keeps the GPU as
    busy as its timing did. Launched eagerly, a launch shorter than its CPU launch overhead (the merge's 4 µs, the
    remaining blocks' 28) leaves the GPU idle between launches and reads a power too low, and so did the Gluon paged
    launch's Python (session 45: 153, 247 and 630 W, against 309, 503 and 694 from a graph)."""
    fn()                                            # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def energy(rows: dict[str, dict]) -> dict[str, dict]:
    """Measured rows {name: {"us", "bytes", "power_w", ...}} and rows["idle"] ({"power_w"}) -> each row with its
    energy a call above idle, "mj", and per byte, "pj_per_byte" (rows without a power reading are left as they
    are; the idle row too)."""
    idle = rows["idle"]["power_w"]
    out = {}
    for name, row in rows.items():
        out[name] = dict(row)
        if name != "idle" and "power_w" in row:
            joules = (row["power_w"] - idle) * row["us"] * 1e-6
            out[name].update(mj=joules * 1e3, pj_per_byte=joules / row["bytes"] * 1e12)
    return out


def measure(method: str, batch: int, length: int, kernels: tuple[str, ...] = ()) -> dict[str, dict]:
    """The rows of the module docstring at Qwen3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), and
    for each of `kernels` (decode_attention's, with TMA copies) its paged launch's arithmetic alone, whole launch and
    call, "arithmetic K", "whole K" and "call K"."""
    device = "cuda"
    hq, h, d = 32, 8, 128
    k, v = random_kv(batch, h, length, d, torch.bfloat16, device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    rows = {"idle": gpu_clocks(lambda: None, device, SAMPLE_SECONDS)}

    def row(name, fn, nbytes):
        seconds = median_seconds(fn, False)
        rows[name] = dict(us=seconds * 1e6, bytes=nbytes, gbs=nbytes / seconds / 1e9,
                          **gpu_clocks(graphed(fn), device, SAMPLE_SECONDS))
        print(f"{name:>10}: " + ", ".join(f"{key} {value:,.1f}" for key, value in rows[name].items()), flush=True)

    row("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, scale=d ** -0.5, enable_gqa=True), 2 * k.numel() * k.element_size())
    layer = filled_layer(method, k, v)
    kv = layer.paged()
    pages = paged_bytes(kv)
    source = torch.empty(pages, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    row("copy", lambda: target.copy_(source), 2 * pages)
    del source, target

    def half(name, part, kernel):
        """Row `name`: part ("copies", "arithmetic" or "whole") of `kernel`'s paged launch (bench.paged_half)."""
        from kernels.decode_gluon import kernel_options
        if not (is_gluon(kernel) and kernel_options(kernel)["use_tma"]):
            print(f"{name:>10}: skipped, {kernel} is not a Gluon kernel with TMA copies (a Hopper GPU's)", flush=True)
            return
        splits = split_count(q, kv, kernel, GLUON_MAXNREG)         # as decode_launches resolves them
        row(name, paged_half(q, kv, splits, gluon_maxnreg(q, kv, splits, kernel), part, kernel=kernel), pages)

    kernel = choose_kernel(q, kv)
    for name in ("copies", "arithmetic", "whole"):
        half(name, name, kernel)
    row("call", decode_launches(q, kv, d ** -0.5, workspace=DecodeWorkspace()), bytes_read(layer))
    row("call-nopdl", decode_launches(q, kv, d ** -0.5, workspace=DecodeWorkspace(), pdl=False), bytes_read(layer))
    # the call's other two launches alone (without PDL, on the buffers of a call just made), as bench attention
    # times them: the remaining blocks (sink and 16-bit buffers: the bytes the pages do not hold) and the merge
    alone = decode_launches(q, kv, d ** -0.5, workspace=DecodeWorkspace(), pdl=False)
    alone()
    row("remaining", alone.remaining, bytes_read(layer) - pages)
    row("merge", alone.merge, bytes_read(layer) - pages)
    for other in kernels:
        half(f"arithmetic {other}", "arithmetic", other)
        half(f"whole {other}", "whole", other)
        row(f"call {other}", decode_launches(q, kv, d ** -0.5, workspace=DecodeWorkspace(), kernel=other),
            bytes_read(layer))
    # the whole paged launch again, last: how far the GPU's warming over the run moves a row's power
    half("whole-again", "whole", kernel)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.energy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="kitty-pro")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--kernels", nargs="*", default=[], type=check_kernel,
                        help="also these decode kernels' arithmetic alone, whole paged launch and call (Gluon kernels "
                             "with TMA copies: gluon-tma-i8 ...)")
    parser.add_argument("--out", type=Path, help="write the rows and the environment as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("backend.energy measures a GPU's power: no GPU here", file=sys.stderr)
        return 2
    rows = energy(measure(args.method, args.batch, args.length, tuple(args.kernels)))
    print(f"{'row':>24} {'us':>9} {'W':>6} {'MHz':>6} {'GPU C':>6} {'HBM C':>6} {'mJ a call':>10} {'pJ / byte':>10}")
    for name, row in rows.items():
        print(f"{name:>24} {row.get('us', 0):9.1f} {row.get('power_w', 0):6.0f} {row.get('sm_mhz', 0):6.0f} "
              f"{row.get('gpu_c', 0):6.0f} {row.get('memory_c', 0):6.0f} "
              f"{row.get('mj', 0):10.1f} {row.get('pj_per_byte', 0):10.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"kind": "energy", "method": args.method, "batch": args.batch,
                                        "length": args.length, "rows": rows,
                                        "env": environment("python -m backend.energy")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
