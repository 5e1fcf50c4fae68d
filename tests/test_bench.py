"""The benchmark command in its --quick mode (tiny shapes on a CPU): it runs, and its JSON holds real rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind,methods", [("attention", {"sdpa-fp16", "kitty", "kitty-pro", "kivi-k2v2", "fp16"}),
                                          ("generate", {"kitty-pro", "kitty", "hf-dynamic", "hf-static"})])
def test_bench_quick_writes_results(tmp_path, kind, methods):
    out = tmp_path / f"{kind}.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", kind, "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kind"] == kind and result["env"]["torch"]
    rows = {row["method"]: row for row in result["rows"] if "error" not in row}
    assert methods <= set(rows), sorted(rows)
    for name in methods:
        row = rows[name]
        if kind == "attention":
            assert row["us"] > 0 and row["vs_sdpa"] > 0
        else:
            assert row["tokens_per_s"] > 0 and row["p50_ms"] > 0 and row["batch"] >= 1
    assert out.with_suffix(".html").exists()                 # the Plotly figure of the table
