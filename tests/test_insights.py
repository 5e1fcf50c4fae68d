"""The insight studies (backend.insights) and the Insights tab.

Each study runs on a tiny random-weight model with small pages (its record's schema, its figure, and what must
hold by construction); the selection study, the CLI and the tab run on the default model with --quick-sized
settings; the records shipped for the default model must be complete and their summaries must follow from their
own numbers (no hand-written claims)."""
from __future__ import annotations

import json

import gradio as gr
import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from conftest import tiny_model

from app import insights_tab
from app.config import AppConfig
from app.runlog import RunLog
from app.services import ModelRegistry, Services
from backend import DEFAULT_MODEL
from backend.insights import STUDIES, channels, layers, load_precomputed, masks, pareto, run_study
from backend.insights.__main__ import main as cli
from backend.insights.common import QUICK_BASE, ranks, spearman, top_overlap
from backend.insights.figures import FIGURES

RECORD_KEYS = {"study", "title", "model", "device", "dtype", "date", "settings", "columns", "rows", "summary"}


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer random model and 100 tokens: with 8-token sinks and 32-token pages, 2 key pages and value pages."""
    model = tiny_model(heads=4, kv_heads=2, head_dim=64, layers=3)
    return model, torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(7))


def check_record(result: dict, study: str) -> None:
    """Complete, strict JSON, a table whose rows fit its columns, a summary its own module writes from the record,
    and a figure whose axes say what they measure."""
    assert result["study"] == study and RECORD_KEYS <= set(result)
    assert result["rows"] and all(len(row) == len(result["columns"]) for row in result["rows"])
    json.dumps(result, allow_nan=False)
    assert result["summary"] == STUDIES[study].summarize(result)
    fig = FIGURES[study](result)
    assert isinstance(fig, go.Figure) and fig.data and fig.layout.title.text
    assert any(name.startswith("xaxis") and fig.layout[name].title.text for name in fig.layout)
    assert all(fig.layout[name].title.text for name in fig.layout if name.startswith("yaxis"))


def test_ranks_spearman_and_overlap():
    assert ranks([5.0, 1.0, 5.0]).tolist() == [2.5, 1.0, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [7, 7, 7]) == 0.0
    assert top_overlap([9, 1, 8, 2], [1, 0, 5, 9], 2) == 0.5


def test_channels_study_records_every_head_and_channel(tiny):
    model, ids = tiny
    result = channels.measure(model, ids, base=QUICK_BASE)
    check_record(result, "channels")
    assert [row[0] for row in result["rows"]] == [0, 1, 2]
    for heads in result["layers"].values():
        assert len(heads) == 2
        for head in heads:
            assert np.array(head["mse"]).shape == (2, 64) and min(min(r) for r in head["mse"]) >= 0
            assert len(head["magnitude"]) == len(head["query_score"]) == 64
            assert -1 <= head["rho_magnitude"] <= 1 and -1 <= head["rho_query"] <= 1
            assert 0 <= head["top_magnitude"] <= 1 and 0 <= head["top_query"] <= 1
    with pytest.raises(ValueError, match="layers"):
        channels.measure(model, ids, layers=[7], base=QUICK_BASE)


def test_masks_study_freezes_the_first_pages_mask(tiny):
    model, ids = tiny
    result = masks.measure(model, ids, base=QUICK_BASE)
    check_record(result, "masks")
    rows = {(r[0], r[1]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in ("magnitude", "query") for m in masks.MODES}
    for selection in ("magnitude", "query"):
        assert rows[(selection, "first page")][5:] == [1.0, 1.0]          # a frozen mask never changes
        assert 0 <= rows[(selection, "per page")][5] <= 1 and rows[(selection, "per page")][2] > 0
        assert len(result["jaccard"][selection]["previous"]) == 3
    assert masks.random_jaccard(1, 2) == pytest.approx(0.5)                # same channel half the time
    gen = torch.Generator().manual_seed(0)                                  # against 20,000 random pairs
    a, b = (torch.zeros(20000, 64, dtype=torch.bool).scatter_(1, torch.rand(20000, 64, generator=gen).argsort(1)[:, :8],
                                                              True) for _ in range(2))
    assert masks.random_jaccard(8, 64) == pytest.approx(((a & b).sum(1) / (a | b).sum(1)).mean().item(), abs=2e-3)


def test_layer_study_keeps_the_total_of_boosted_channels(tiny):
    model, ids = tiny
    held_out = torch.randint(3, 256, (1, 100), generator=torch.Generator().manual_seed(8))
    result = layers.measure(model, ids, held_out, base=QUICK_BASE)
    check_record(result, "layers")
    assert result["settings"]["held-out tokens"] == 100 and all(row[6] > 0 for row in result["rows"])
    assert result["sensitivity"]["layers"] == [0, 1, 2] and min(result["sensitivity"]["kl"]) > 0
    assert {sum(counts) for counts in result["allocations"].values()} == {3 * 8}
    assert len({row[2] for row in result["rows"]}) == 1                    # same boosted channels: same bytes
    assert layers.allocate([1, 0, 3], 8, 5) == [3, 0, 5]                   # the capped layer's excess moves
    assert layers.allocate([1, 1, 1], 4, 64) == [2, 1, 1]


def test_pareto_study_marks_the_frontier(tiny):
    model, ids = tiny
    result = pareto.measure(model, ids, sinks=(0, 8), windows=(32,), pages=(32,), alphas=(0.0, 0.25),
                            long_tokens=4096, base=QUICK_BASE)
    check_record(result, "pareto")
    assert len(result["rows"]) == 4 and any(row[8] for row in result["rows"]) and any(row[9] for row in result["rows"])
    assert pareto.frontier([(1, 3), (2, 2), (2, 5), (3, 2.5), (4, 1)]) == [True, True, False, False, True]


def test_selection_study_on_the_default_model(default_model):
    model, tokenizer = default_model
    result = run_study("selection", model, tokenizer, quick=True)
    check_record(result, "selection")
    assert [row[0] for row in result["rows"]] == ["fp16 (reference)", "magnitude", "random", "query"]
    assert all(row[2] == 8 and row[3] > 0 and row[7] in ("0/1", "1/1") for row in result["rows"][1:])


def test_cli_writes_records_and_figures(tmp_path):
    out = tmp_path / "insights.json"
    assert cli(["channels", "--quick", "--out", str(out)]) == 0
    record = json.loads(out.read_text())["studies"]["channels"]
    check_record(record, "channels")
    assert record["command"] == f"python -m backend.insights channels --quick --out {out}"
    assert (tmp_path / "insights-channels.html").stat().st_size > 10_000


def test_shipped_records_for_the_default_model():
    """backend/data/insights.json: every study, made by the documented command on the default model with the
    full settings."""
    shipped = load_precomputed()
    assert set(shipped) == set(STUDIES)
    for name, result in shipped.items():
        check_record(result, name)
        assert result["model"] == DEFAULT_MODEL and result["device"] == "cpu" and result["dtype"] == "float32"
        assert result["command"].startswith("python -m backend.insights ") and "--quick" not in result["command"]
        assert result["settings"]["text tokens"] == STUDIES[name].SETTINGS["full"]["tokens"]


def test_insights_tab_shows_the_shipped_records_and_runs_a_study_live(default_model, tmp_path):
    db_url = f"sqlite:///{tmp_path / 'runs.sqlite3'}"
    services = Services(AppConfig(db_url=db_url), ModelRegistry(loader=lambda name: default_model), RunLog(db_url))
    with gr.Blocks():
        page = insights_tab.build(services)
    assert set(page.views) == set(STUDIES)
    for name, view in page.views.items():
        progress, source, summary, table, plot = view.outputs[:5]
        assert "Precomputed" in source.value and page.precomputed[name]["summary"] in summary.value
        assert plot.value is not None
    updates = list(page.run("channels", 289, 3))
    assert "Finished" in updates[-1][0] and updates[-1][5]["settings"]["layers"] == [3]
    assert all("kitty-progress" in u[0] for u in updates[:-1])
    again = list(page.run("channels", 289, 3))                               # remembered: no second run
    assert len(again) == 1 and "earlier live run" in again[0][0]
    assert isinstance(page.redraw_channels(updates[-1][5], 3, 1), go.Figure)
