"""What one decode-attention launch waits on, instruction by instruction: Nsight Compute on the GPU, summarized.

    python -m backend.kernel_profile --out DIR [--name profile] [--kernel-regex _gluon_paged_kernel]
                                     [--command attention|tune] [--nvtx-range NAME] [-- BENCH ARGS]

Runs `ncu` (Nsight Compute, which ships with the CUDA toolkit on the device) on the first launch of the kernel
whose name matches --kernel-regex inside `python -m backend.bench attention BENCH ATTENTION ARGS` (default: the
Gluon kernel, kitty-pro, batch 64, 32K tokens), with the sections that say where warps wait (warp states,
schedulers, occupancy, pipes, speed of light) and per-instruction stall samples (SourceCounters). It writes into
DIR, under --name:
  - NAME_details.txt: ncu's sections as text;
  - NAME_source.csv: the SASS with every per-instruction column ncu exports (`--page source --csv`);
  - NAME.json: the summary (summarize_source): per opcode and per instruction, the sum of every numeric
    column of the source page, the heaviest first by stall samples.
Sessions 10 and 11 read those samples by hand (BENCHMARKS.md section 1); this keeps the command and the reading
in the repository, for one device call. No GPU here: the summary is tested on a CSV of the source page's shape.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# MemoryWorkloadAnalysis: L1 / L2 / DRAM and shared-memory traffic, because the paged kernel is neither issue- nor
# DRAM-bound (issue slots 52 %, DRAM 72 %, session 16) and one early profile read L2 at 82 % (session 11)
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "SchedulerStats", "WarpStateStats", "SourceCounters")
DEFAULT_BENCH = ["--kernels", "auto", "--methods", "kitty-pro", "--batches", "64", "--lengths", "32768"]
# the source page's column of the instruction text, and the stall-sample column the ranking uses where present
SOURCE_COLUMN = "Source"
SAMPLES = re.compile(r"warp stall sampling \(all", re.IGNORECASE)
# "@!P0 LDG.E.U16 R1, ..." -> "LDG"
OPCODE = re.compile(r"^\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def number(text: str) -> float | None:
    """A CSV cell as a number (ncu writes thousands separators), None when it is not one."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def summarize_source(text: str, top: int = 40) -> dict:
    """The source page's CSV -> {"columns", "ranked_by", "opcodes": [{opcode, instructions, <column>: sum}],
    "instructions": the `top` heaviest rows}: every numeric column summed per opcode (the first word of the SASS,
    predicate dropped), both lists sorted by the stall-sample column (or the first numeric one)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or SOURCE_COLUMN not in rows[0]:
        raise ValueError(f"not an ncu source page: no {SOURCE_COLUMN!r} column in {list(rows[0]) if rows else []}")
    numeric = [c for c in rows[0] if c != SOURCE_COLUMN and any(number(r[c]) is not None for r in rows)]
    ranked = next((c for c in numeric if SAMPLES.search(c)), numeric[0] if numeric else None)
    opcodes = collections.defaultdict(collections.Counter)
    instructions = []
    for row in rows:
        match = OPCODE.match(row[SOURCE_COLUMN] or "")
        if not match:
            continue
        values = {c: number(row[c]) or 0.0 for c in numeric}
        opcodes[match.group(1)].update(values)
        opcodes[match.group(1)]["instructions"] += 1
        instructions.append({"source": row[SOURCE_COLUMN].strip(), **{k: v for k, v in row.items()
                                                                     if k not in numeric and k != SOURCE_COLUMN},
                             **values})
    key = (lambda item: -item.get(ranked, 0.0)) if ranked else (lambda item: 0)
    table = sorted(({"opcode": op, **counts} for op, counts in opcodes.items()), key=key)
    return {"columns": numeric, "ranked_by": ranked, "opcodes": table,
            "instructions": sorted(instructions, key=key)[:top]}


def ncu_commands(work: Path, kernel_regex: str, bench_args: list[str], command: str = "attention",
                 nvtx_range: str | None = None) -> list[list[str]]:
    """The profiling run and the two exports of its report (details as text, the source page as CSV); the report
    and the bench's own JSON go to `work` (not the output folder: the device brings back 8 files at most).
    command: the bench command run under ncu (`attention`, or `tune`, whose settings' launches each sit in an NVTX
    range, bench.tune_range); nvtx_range: profile only a launch inside that push / pop range."""
    report = work / "profile"
    nvtx = ["--nvtx", "--nvtx-include", f"{nvtx_range}/"] if nvtx_range else []
    profile = ["ncu", "--clock-control", "none", "-f", "-o", str(report), "-k", f"regex:{kernel_regex}", "-c", "1",
               *nvtx, *[a for s in SECTIONS for a in ("--section", s)], sys.executable, "-m", "backend.bench",
               command, *bench_args, "--out", str(work / "bench.json")]
    details = ["ncu", "-i", f"{report}.ncu-rep", "--page", "details"]
    source = ["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]
    return [profile, details, source]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.kernel_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="profile", help="the output files' name")
    parser.add_argument("--kernel-regex", default="_gluon_paged_kernel")
    parser.add_argument("--command", choices=["attention", "tune"], default="attention",
                        help="the bench command to run under ncu")
    parser.add_argument("--nvtx-range", help="profile a launch inside this NVTX range (bench tune's settings: "
                                             "backend.bench.tune_range, e.g. gluon-tma.arithmetic.168)")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="arguments of `python -m backend.bench COMMAND` after `--`")
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench if a != "--"] or DEFAULT_BENCH
    args.out.mkdir(parents=True, exist_ok=True)
    profile, details, source = ncu_commands(Path(tempfile.mkdtemp(prefix="kernel_profile")), args.kernel_regex,
                                            bench_args, args.command, args.nvtx_range)
    subprocess.run(profile, check=True)
    (args.out / f"{args.name}_details.txt").write_text(subprocess.run(details, check=True, capture_output=True,
                                                                 text=True).stdout)
    csv_text = subprocess.run(source, check=True, capture_output=True, text=True).stdout
    (args.out / f"{args.name}_source.csv").write_text(csv_text)
    # ncu may print a line or two before the CSV's header, the first line with a quoted "Source" column
    header = next((i for i, line in enumerate(csv_text.splitlines()) if f'"{SOURCE_COLUMN}"' in line), 0)
    summary = summarize_source("\n".join(csv_text.splitlines()[header:]))
    summary.update(kernel_regex=args.kernel_regex, bench=bench_args)
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    for row in summary["opcodes"][:15]:
        print(f"{row['opcode']:>10} {int(row['instructions']):>5} instructions", *(
            f"{c} {row[c]:.0f}" for c in summary["columns"][:4]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
