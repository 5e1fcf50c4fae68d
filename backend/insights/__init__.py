"""Studies the paper leaves open, run on any loaded model (app/insights_tab.py shows them, `python -m
backend.insights` runs them from the command line):

- selection: query-aware channel selection against magnitude and random (teacher-forced KL, perplexity, pass-key);
- channels:  the paper's Figure 2b on every layer: the attention error of each channel alone at 2 bits, beside the
             magnitude and query-aware rankings, with rank correlations;
- masks:     how much the boosted set changes from page to page, and a mask frozen after the first page;
- layers:    the KL when only one layer is at 2 bits, and a layer-wise boost budget with the same total bits;
- pareto:    sink, window, page size and alpha against bits per element and KL.

Each study is a module with `run(model, tokenizer, *, progress, **settings) -> dict` (a JSON-ready record:
settings, a table, a summary written from the numbers, data for its figure) and SETTINGS["full" | "quick"];
figures.FIGURES draws each record. backend/data/insights.json holds the records for the default model.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import channels, layers, masks, pareto, selection
from .common import Progress

STUDIES = {"selection": selection, "channels": channels, "masks": masks, "layers": layers, "pareto": pareto}
PRECOMPUTED = Path(__file__).resolve().parent.parent / "data" / "insights.json"


def run_study(name: str, model, tokenizer, *, quick: bool = False, progress: Progress | None = None,
              **overrides) -> dict:
    """One study with its full (or --quick) settings, any of them overridden."""
    module = STUDIES[name]
    return module.run(model, tokenizer, progress=progress, **{**module.SETTINGS["quick" if quick else "full"],
                                                              **overrides})


def load_precomputed(path: Path = PRECOMPUTED) -> dict[str, dict]:
    """The shipped records for the default model, by study ({} when there are none)."""
    return json.loads(path.read_text())["studies"] if path.exists() else {}
