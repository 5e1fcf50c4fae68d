"""Everything a GPU run must say, in one command: the kernel and cache tests compiled on the GPU, the decode
attention table, the launch-setting sweep, where a decode call's energy goes (backend.energy), a generation table,
a chat's next turn on a ragged batch, (when a checkout of an earlier commit is given) the earlier kernel's attention
table measured in the same run, and (when asked for) Nsight Compute's stall samples of one launch by instruction
(backend.kernel_profile).

    python -m backend.gpu_report --out DIR [--steps tests attention tune energy generate turn profile] [--baseline PATH]
                                 [--baseline-attention ARGS]
                                 [--budget-s 560] [--generate "--prompt 512 --new-tokens 256" ...] [--attention ARGS]
                                 [--tune ARGS] [--energy ARGS]
                                 [--turn ARGS] [--profile ARGS] [--pytest "tests/test_graphs.py -k graphed"]

Each step is its own process with a share of the time budget; its output goes to DIR/log.txt and its results to
DIR/<step>.json (few files: the device tool brings back at most 8); each --generate argument list is one
generation table, DIR/generate<k>.json, and each --profile one profile, DIR/profile<k>.json, _details.txt and
_source.csv. Steps that do not fit the budget are skipped and say so. BENCHMARKS.md records what each run printed,
with this command.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("tests", "attention", "tune", "energy", "baseline", "generate", "turn", "profile")


def step_commands(args, out: Path) -> dict[str, list[tuple[list[str], str | None]]]:
    """Command lines and working directory of each step."""
    py = sys.executable
    xdist = ["-n", "8"] if _has_module("xdist") else []
    return {
        "tests": [([py, "-m", "pytest", "-q", "-rf", "--tb=short", "-p", "no:cacheprovider", *xdist,
                    *shlex.split(args.pytest)], None)],
        "attention": [([py, "-m", "backend.bench", "attention", *shlex.split(args.attention),
                        "--out", str(out / "attention.json")], None)],
        "tune": [([py, "-m", "backend.bench", "tune", *shlex.split(args.tune), "--out", str(out / "tune.json")], None)],
        "energy": [([py, "-m", "backend.energy", *shlex.split(args.energy), "--out", str(out / "energy.json")], None)],
        "baseline": [([py, "-m", "backend.bench", "attention", *shlex.split(args.baseline_attention),
                       "--out", str(out / "baseline.json")], args.baseline)],
        "generate": [([py, "-m", "backend.bench", "generate", *shlex.split(extra),
                       "--out", str(out / f"generate{k}.json")], None) for k, extra in enumerate(args.generate)],
        "turn": [([py, "-m", "backend.bench", "turn", *shlex.split(args.turn), "--out", str(out / "turn.json")], None)],
        "profile": [([py, "-m", "backend.kernel_profile", "--out", str(out), "--name", f"profile{k}",
                      *profile_arguments(extra)], None) for k, extra in enumerate(args.profile)],
    }


def profile_arguments(extra: str) -> list[str]:
    """One --profile ARGS as backend.kernel_profile's arguments: the bench's arguments, or, where ARGS holds a
    ` -- `, kernel_profile's own options before it (--command tune --nvtx-range NAME) and the bench's after."""
    own, _, bench = f" {extra} ".rpartition(" -- ")
    return [*shlex.split(own), "--", *shlex.split(bench)]


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.gpu_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", nargs="*", default=[s for s in STEPS if s != "profile"], choices=STEPS,
                        help="steps to run, in this order (default: all but profile)")
    parser.add_argument("--baseline", help="root of an earlier checkout whose kernel is measured for comparison")
    parser.add_argument("--baseline-attention", default="--methods kitty-pro kivi-k2v2", metavar="ARGS",
                        help="arguments of the baseline checkout's `bench attention` step")
    parser.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget for all steps")
    parser.add_argument("--step-s", nargs="*", default=[], metavar="STEP=SECONDS",
                        help="time limit of a step (default: what is left of the budget)")
    parser.add_argument("--generate", action="append", metavar="ARGS",
                        help="arguments of one `bench generate` run (repeatable; default: 512 + 256 tokens, "
                             "HF static FP16 and kitty-pro)")
    parser.add_argument("--attention", default="", metavar="ARGS",
                        help="arguments of the `bench attention` step (e.g. \"--kernels triton gluon\")")
    parser.add_argument("--tune", default="", metavar="ARGS",
                        help="arguments of the `bench tune` step (e.g. \"--vary warps kernel --batches 1 8\"; default: "
                             "every sweep at every shape)")
    parser.add_argument("--energy", default="", metavar="ARGS",
                        help="arguments of the `backend.energy` step (default: kitty-pro, batch 64, 32K tokens)")
    parser.add_argument("--turn", default="", metavar="ARGS",
                        help="arguments of the `bench turn` step (default: 16 sequences of 4,352-8,192 tokens, a turn "
                             "of 256)")
    parser.add_argument("--profile", action="append", metavar="ARGS",
                        help="the `bench attention` arguments of one profile (repeatable: DIR/profile<k>*, three "
                             "files each; backend.kernel_profile, Nsight Compute on one launch of the Gluon kernel; "
                             "default: kitty-pro, batch 64, 32K tokens), or kernel_profile's options, ` -- ` and the "
                             "bench's arguments (\"--command tune --nvtx-range gluon-tma.arithmetic.168 -- --vary "
                             "loads ...\")")
    parser.add_argument("--pytest", default="tests/test_kernels.py tests/test_cache.py tests/test_graphs.py "
                        "tests/test_flush.py",
                        help="what the tests step runs: pytest arguments (files, -k EXPR)")
    args = parser.parse_args(argv)
    args.generate = args.generate or ["--prompt 512 --new-tokens 256 --methods hf-static kitty-pro"]
    args.profile = args.profile or [""]
    args.out.mkdir(parents=True, exist_ok=True)
    limits = {k: float(v) for k, v in (item.split("=") for item in args.step_s)}
    deadline = time.monotonic() + args.budget_s
    commands = step_commands(args, args.out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()}
    status = {}
    with open(args.out / "log.txt", "a") as log:
        for step in args.steps:
            for k, (command, cwd) in enumerate(commands[step]):
                name = step if len(commands[step]) == 1 else f"{step}{k}"
                if step == "baseline" and not cwd:
                    status[name] = "skipped: no --baseline checkout"
                    continue
                left = deadline - time.monotonic()
                limit = min(left, limits.get(name, limits.get(step, left)))
                if limit < 20:
                    status[name] = "skipped: out of time"
                    continue
                log.write(f"\n===== {name}: {' '.join(command)} (cwd {cwd or '.'}, limit {limit:.0f} s)\n")
                log.flush()
                start = time.monotonic()
                try:
                    run = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                         env={**env, "PYTHONPATH": os.pathsep.join(
                                             filter(None, [cwd or os.getcwd(), os.environ.get("PYTHONPATH")]))})
                    status[name] = f"exit {run.returncode} in {time.monotonic() - start:.0f} s"
                except subprocess.TimeoutExpired:
                    status[name] = f"timed out after {limit:.0f} s"
                log.write(f"===== {name}: {status[name]}\n")
                log.flush()
                print(f"{name}: {status[name]}", flush=True)
    return 0 if all(s.startswith(("exit 0", "skipped")) for s in status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
