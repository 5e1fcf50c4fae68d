"""python -m backend.insights STUDY [STUDY ...] | all [--quick] [--out FILE.json]: run studies on the default model
(or --model); records merge into FILE.json by study, each study's Plotly figure beside it as FILE-STUDY.html.
python -m backend.insights plot --out FILE.json draws the figures of records already measured.

The shipped records: python -m backend.insights all --no-figures --out backend/data/insights.json"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from ..model import load_model
from . import STUDIES, run_study


def printer(name: str):
    """A progress callback that prints a line every 5 % to stderr."""
    started, shown = time.monotonic(), [-1]

    def show(fraction: float, message: str) -> None:
        step = int(fraction * 20)
        if step > shown[0]:
            shown[0] = step
            print(f"[{name}] {fraction:4.0%} {time.monotonic() - started:6.0f} s  {message}", file=sys.stderr,
                  flush=True)
    return show


def write_figures(studies: dict[str, dict], out: Path) -> list[Path]:
    from .figures import FIGURES
    paths = []
    for name, result in studies.items():
        path = out.with_name(f"{out.stem}-{name}.html")
        FIGURES[name](result).write_html(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.insights", description=__doc__.split("\n")[0])
    parser.add_argument("studies", nargs="+", choices=[*STUDIES, "all", "plot"])
    parser.add_argument("--quick", action="store_true", help="small text and pages: a CI-sized run")
    parser.add_argument("--out", type=Path, help="JSON to write (records merge into it by study); for plot: the JSON")
    parser.add_argument("--no-figures", action="store_true", help="write the JSON only")
    parser.add_argument("--model", default=None, help="model id or folder (default: the default model)")
    parser.add_argument("--device", default="cpu", help="cpu (default: what the shipped records used), cuda, auto")
    parser.add_argument("--tokens", type=int, help="text length in tokens (overrides the study's setting)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.studies == ["plot"]:
        for path in write_figures(json.loads(args.out.read_text())["studies"], args.out):
            print(path)
        return 0
    names = list(STUDIES) if "all" in args.studies else list(dict.fromkeys(args.studies))
    model, tokenizer = load_model(args.model, device=args.device)
    overrides = {"tokens": args.tokens} if args.tokens else {}
    command = "python -m backend.insights " + shlex.join(argv if argv is not None else sys.argv[1:])
    existing = json.loads(args.out.read_text()) if args.out and args.out.exists() else {"studies": {}}
    for name in names:
        result = run_study(name, model, tokenizer, quick=args.quick, progress=printer(name), **overrides)
        result["command"] = command
        print(f"[{name}] {result['summary']}", file=sys.stderr)
        existing["studies"][name] = result
        if args.out:                                # after every study: a long run keeps what it finished
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(existing, indent=1) + "\n")
        else:
            print(json.dumps(result, indent=1))
    if args.out and not args.no_figures:
        for path in write_figures({n: existing["studies"][n] for n in names}, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
