"""Bad input on the Compare tab gets a clear message in the page, never a stack trace; a broken database neither
costs the answers nor (once it is back) the history entry. These drive the tab's Send handler directly (the exact
function the button runs), with the tab built inside a gr.Blocks."""
from __future__ import annotations

import shutil
import sqlite3
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import gradio as gr
import pytest

from app import compare_tab
from app.compare_tab import PANE_METHODS, CompareSession
from app.config import AppConfig
from app.runlog import RunLog
from app.services import ModelRegistry, Services
from storage import Database

CUSTOM = dict(k_bits=2, v_bits=2, alpha=0.125, sink=32, page_size=128, window=128, selection="magnitude")
GENERATION = dict(max_new_tokens=4, decoding="greedy", temperature=0.7, top_p=0.95, top_k=50, seed=0)


@pytest.fixture
def page_for(default_model, tmp_path):
    """page_for(db_url=..., **config) -> the Compare tab built over the default model and that database."""
    def build(db_url: str | None = None, **config):
        db_url = db_url or f"sqlite:///{tmp_path / 'runs.sqlite3'}"
        services = Services(AppConfig(db_url=db_url, **config), ModelRegistry(loader=lambda name: default_model),
                            RunLog(db_url))
        with gr.Blocks():
            return compare_tab.build(services)
    return build


def send(page, prompt="Name a colour.", methods=("fp16", "kitty"), custom=None, model="", **generation):
    """Run the Send handler to the end; returns the merged outputs (component -> last value)."""
    c = {**CUSTOM, **(custom or {})}
    g = {**GENERATION, **generation}
    outputs = {}
    for update in page.send(CompareSession(), prompt, list(methods), *c.values(), *g.values(), model, "kitty", 10, 0,
                            *[[] for _ in PANE_METHODS]):
        outputs.update(update)
    return outputs


def status_of(page, outputs) -> str:
    return outputs[page.status]


def answer(page, outputs, method) -> str:
    return compare_tab._text(outputs[page.chats[method]][-1]["content"])


def slug_in(status: str) -> str:
    return status.split("?run=")[1].split('"')[0]


def stored(db_path: Path, slug: str, timeout: float = 20.0):
    """The run once the run log's writer has it in the database (it retries in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        run = Database(f"sqlite:///{db_path}").get_run(slug) if db_path.exists() else None
        if run is not None and run.status != "running" or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def test_empty_prompt(page_for):
    page = page_for()
    for prompt in ("", "   \n "):
        out = send(page, prompt=prompt)
        assert "kitty-error" in status_of(page, out) and "The prompt is empty" in status_of(page, out)
        assert page.chats["fp16"] not in out                   # nothing ran


def test_prompt_longer_than_the_context(page_for):
    page = page_for()
    out = send(page, prompt="cat " * 9000)
    assert "kitty-error" in status_of(page, out)
    assert "longer than the model&#x27;s context of 8192 tokens" in status_of(page, out)
    out = send(page, prompt="cat " * 8100, max_new_tokens=500)
    assert "with 500 new tokens that exceeds the model&#x27;s context" in status_of(page, out)


def test_max_new_tokens_beyond_the_cap(page_for):
    page = page_for()
    assert "between 1 and 1024 on this server (got 5000)" in status_of(page, send(page, max_new_tokens=5000))
    capped = page_for(max_new_tokens_cap=32)
    assert "between 1 and 32 on this server (got 33)" in status_of(capped, send(capped, max_new_tokens=33))
    assert "Max new tokens must be a whole number" in status_of(page, send(page, max_new_tokens=None))


def test_the_page_refuses_what_the_api_refuses(page_for):
    """The number fields hand 2.5 over as is (no rounding to 2), and the handler refuses it as the API does."""
    page = page_for()
    max_new_tokens, seed = page.generation[0], page.generation[5]
    assert max_new_tokens.preprocess(2.5) == 2.5 and seed.preprocess(1e30) == 1e30
    for kwargs, message in (({"max_new_tokens": max_new_tokens.preprocess(2.5)}, "Max new tokens must be a whole "
                                                                                  "number (got 2.5)"),
                            ({"seed": seed.preprocess(1e30)}, "seed must be a whole number from 0 to 4294967295"),
                            ({"seed": -1}, "seed must be a whole number from 0 to 4294967295"),
                            ({"top_k": 2**40}, "Top-k must be 0 (off) to 4294967295"),
                            ({"temperature": float("nan")}, "Temperature must be a number")):
        out = send(page, **kwargs)
        assert "kitty-error" in status_of(page, out) and message in status_of(page, out), kwargs
        assert page.chats["fp16"] not in out


def test_sizes_beyond_the_model_context_are_refused_before_allocating(page_for):
    page = page_for()
    for custom, name in (({"sink": 40000}, "sink=40000"), ({"window": 10**9}, "local_window=1000000000")):
        out = send(page, methods=("custom",), custom={**custom, "k_bits": 16, "v_bits": 16, "alpha": 0})
        assert f"Custom method: {name} is larger than the model&#x27;s context of 8192 tokens" in status_of(page, out)
    limited = page_for(max_prompt_chars=1000, max_messages=3)
    out = send(limited, prompt="cat " * 300)
    assert "The conversation is 1,199 characters long; this server takes at most 1,000" in status_of(limited, out)
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}] * 2
             if label == "fp16" else [] for label in PANE_METHODS]
    outputs = {}
    for update in limited.send(CompareSession(), "And now?", ["fp16"], *CUSTOM.values(), *GENERATION.values(), "",
                               "kitty", 10, 0, *chats):
        outputs.update(update)
    assert "The conversation has 5 messages; this server takes at most 3" in status_of(limited, outputs)


@pytest.mark.parametrize("custom, message", [
    ({"k_bits": 4}, "Custom method: alpha=0.125 boosts 2-bit key channels, but k_bits=4"),
    ({"page_size": 130}, "Custom method: page_size=130 must be a positive multiple of 4"),
    ({"k_bits": 3}, "Custom method: k_bits=3 is not supported: choose one of (2, 4, 16)"),
    ({"alpha": 1.5}, "Custom method: alpha=1.5 must be a number in [0, 1]"),
    ({"sink": None}, "Sink must be a whole number"),
])
def test_invalid_custom_settings(page_for, custom, message):
    page = page_for()
    out = send(page, methods=("fp16", "custom"), custom=custom)
    assert "kitty-error" in status_of(page, out)
    assert message.replace("'", "&#x27;") in status_of(page, out)


def test_custom_settings_are_ignored_when_custom_is_not_chosen(page_for):
    page = page_for()
    out = send(page, methods=("fp16",), custom={"page_size": 130})
    assert "kitty-ok" in status_of(page, out) and answer(page, out, "fp16")


def test_other_models_need_the_operators_permission(page_for):
    page = page_for()
    out = send(page, model="gpt2")
    assert "only serves SmolLM2-135M-Instruct" in status_of(page, out)
    assert "--allow-any-model" in status_of(page, out)


def test_locked_database_still_shows_the_answers_and_keeps_the_run(page_for, tmp_path):
    db_path = tmp_path / "locked.sqlite3"
    page = page_for(f"sqlite:///{db_path}")
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")                    # another process holds the write lock past the timeout
    try:
        out = send(page)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    status = status_of(page, out)
    assert "kitty-warning" in status and "Not saved yet (the database is locked by another writer)" in status
    assert str(tmp_path) not in status and "sqlite:" not in status        # the details stay in the server log
    assert answer(page, out, "fp16") and answer(page, out, "kitty")
    assert "done" in out[page.metrics["kitty"]]
    # Once the lock is gone the waiting run is written, with nothing sent again
    run = stored(db_path, slug_in(status))
    assert run is not None and run.status == "ok" and [r.method for r in run.results] == ["fp16", "kitty"]
    assert "Saved as run" in status_of(page, send(page))


def test_a_deleted_database_file_is_recreated(page_for, tmp_path):
    folder = tmp_path / "store"
    page = page_for(f"sqlite:///{folder / 'runs.sqlite3'}")
    assert "Saved as run" in status_of(page, send(page))
    for path in folder.iterdir():                        # someone deleted the database (and its WAL files)
        path.unlink()
    out = send(page)
    assert "Saved as run" in status_of(page, out) and answer(page, out, "kitty")
    assert stored(folder / "runs.sqlite3", slug_in(status_of(page, out))).status == "ok"


def test_a_removed_database_folder_keeps_the_runs_until_it_is_back(page_for, tmp_path):
    folder = tmp_path / "store"
    page = page_for(f"sqlite:///{folder / 'runs.sqlite3'}")
    first = slug_in(status_of(page, send(page)))
    shutil.copytree(folder, tmp_path / "backup")
    shutil.rmtree(folder)
    out = send(page)
    status = status_of(page, out)
    assert "Not saved yet (the database folder is missing)" in status and answer(page, out, "kitty")
    assert str(folder) not in status
    shutil.copytree(tmp_path / "backup", folder)         # the volume is back
    assert stored(folder / "runs.sqlite3", slug_in(status)).status == "ok"
    assert stored(folder / "runs.sqlite3", first).status == "ok"


def test_unreachable_database_at_start_up_keeps_serving(page_for, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the database folder should be")
    page = page_for(f"sqlite:///{blocker / 'runs.sqlite3'}")
    assert page.services.runlog.startup_error
    out = send(page)
    assert "Not saved yet (the database is unavailable)" in status_of(page, out) and answer(page, out, "kitty")
    assert str(blocker) not in status_of(page, out)


def test_one_method_failing_shows_in_its_pane_only(page_for, monkeypatch):
    import torch

    import backend.engine as engine
    real = engine.make_cache

    def make_cache(model, config):
        if config.name == "kitty":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(model, config)

    monkeypatch.setattr(engine, "make_cache", make_cache)
    page = page_for()
    out = send(page)
    assert "1 of 2 methods finished; failed: kitty" in status_of(page, out)
    assert "Out of memory: CUDA out of memory. Tried to allocate 20.00 MiB" in out[page.metrics["kitty"]]
    assert "Out of memory" in answer(page, out, "kitty") and "Out of memory" not in answer(page, out, "fp16")
    assert "Traceback" not in str(out)


def test_no_handler_path_leaks_a_stack_trace(page_for):
    """Every bad input above ends in a status box: the handler never raises."""
    page = page_for()
    for kwargs in ({"prompt": ""}, {"max_new_tokens": -1}, {"methods": ()}, {"top_k": 1.5, "decoding": "sample"},
                   {"methods": ("custom",), "custom": {"window": -1}}, {"seed": float("nan")},
                   {"temperature": None}, {"methods": ("custom",), "custom": {"alpha": "lots"}}):
        out = send(page, **kwargs)
        assert "kitty-error" in status_of(page, out), kwargs
        assert "Traceback" not in status_of(page, out)


def test_an_allowed_model_that_cannot_load_gets_a_message(default_model, tmp_path):
    from backend import load_model
    services = Services(AppConfig(allow_any_model=True), ModelRegistry(
        allow_any=True, loader=lambda name: default_model if name is None else load_model(name, device="cpu")),
        RunLog(f"sqlite:///{tmp_path / 'runs.sqlite3'}"))
    with gr.Blocks():
        page = compare_tab.build(services)
    out = send(page, model="no-such-org/no-such-model")
    assert "Could not load the model &#x27;no-such-org/no-such-model&#x27;" in status_of(page, out)


def test_a_second_turn_sends_each_pane_its_own_history(page_for):
    page = page_for()
    previous = {"fp16": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
                "kitty": [{"role": "user", "content": "Name a colour."},
                          {"role": "assistant", "content": "Red.", "metadata": None},
                          {"role": "assistant", "content": "✕ failed", "metadata": {"title": "This method failed"}}]}
    session = CompareSession()
    chats = [previous.get(label, []) for label in PANE_METHODS]
    outputs = {}
    for update in page.send(session, "And another one?", ["fp16", "kitty"], *CUSTOM.values(), *GENERATION.values(),
                            "", "kitty", 10, 0, *chats):
        outputs.update(update)
    jobs = session.comparison._jobs
    from backend.engine import encode_chat
    tokenizer = page.services.models.default[1]
    for label, answer_text in (("fp16", "Blue."), ("kitty", "Red.")):   # the error note is not sent to the model
        expected = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": answer_text},
                    {"role": "user", "content": "And another one?"}]
        assert jobs[label].input_ids.tolist() == encode_chat(tokenizer, expected).tolist()
        shown = outputs[page.chats[label]]
        assert compare_tab._text(shown[-2]["content"]) == "And another one?" and shown[-1]["role"] == "assistant"
    assert len(outputs[page.chats["fp16"]]) == 4


def test_history_messages_for_unknown_runs_and_export(default_model, tmp_path):
    from app import history_tab
    db_url = f"sqlite:///{tmp_path / 'runs.sqlite3'}"
    services = Services(AppConfig(db_url=db_url), ModelRegistry(loader=lambda name: default_model), RunLog(db_url))
    with gr.Blocks():
        compare = compare_tab.build(services)
        history = history_tab.build(services)
    slug = status_of(compare, send(compare)).split("Saved as run ")[1].split(".")[0]

    view = dict(zip(history.view_outputs, history.open_run("nosuchrun1")))
    assert "No run &#x27;nosuchrun1&#x27; in this database" in view[history.message]
    view = dict(zip(history.view_outputs, history.open_run("")))
    assert "Type a run id" in view[history.message]
    view = dict(zip(history.view_outputs, history.open_run(slug)))
    assert f"Run {slug}" in view[history.header] and [row[0] for row in view[history.metrics]] == ["fp16", "kitty"]

    rows, message, *_ = history.search("kitty", "any", None, None)
    assert [row[0] for row in rows] == [slug] and "1 run(s)" in message
    rows, *_ = history.search("kivi-k4v4", "any", None, None)
    assert rows == []
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    rows, *_ = history.search("any", "SmolLM2-135M-Instruct", today, today)     # a picked date is the whole day
    assert [row[0] for row in rows] == [slug]
    rows, *_ = history.search("any", "any", None, today - timedelta(days=1))
    assert rows == []
    csv_update, message = history.export("any", "any", None, None)
    assert "Exported 2 row(s)" in message
    assert Path(csv_update["value"]).read_text().count(slug) == 2


def test_the_service_binds_locally_unless_told_otherwise(monkeypatch):
    from app.config import parse_args
    for name in ("KITTY_HOST", "GRADIO_SERVER_NAME", "KITTY_PORT", "GRADIO_SERVER_PORT", "KITTY_ALLOW_ANY_MODEL"):
        monkeypatch.delenv(name, raising=False)
    config = parse_args([])
    assert (config.host, config.port, config.share, config.allow_any_model) == ("127.0.0.1", 7860, False, False)
    assert parse_args(["--host", "0.0.0.0", "--port", "8000"]).host == "0.0.0.0"
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")          # what Hugging Face Spaces sets
    assert parse_args([]).host == "0.0.0.0"
    monkeypatch.setenv("KITTY_HOST", "127.0.0.2")
    monkeypatch.setenv("KITTY_ALLOW_ANY_MODEL", "1")
    monkeypatch.setenv("KITTY_MAX_NEW_TOKENS", "256")
    config = parse_args([])
    assert (config.host, config.allow_any_model, config.max_new_tokens_cap) == ("127.0.0.2", True, 256)


def test_only_the_latest_comparisons_keep_their_caches(page_for):
    page = page_for()
    page.services.kept.max_count = 1
    sessions = [CompareSession(), CompareSession()]
    for session in sessions:
        for _ in page.send(session, "Name a colour.", ["kitty"], *CUSTOM.values(), *GENERATION.values(), "",
                           "kitty", 3, 0, *[[] for _ in PANE_METHODS]):
            pass
    old, new = (s.comparison for s in sessions)
    assert old.released and old.key_magnitudes("kitty", 3) is None
    assert not new.released and new.key_magnitudes("kitty", 3) is not None
    figures = compare_tab.live_figures(old, "kitty", 3, 0)
    assert "freed to save memory" in str(figures[1].to_dict())


def test_kept_caches_stay_within_the_memory_budget(default_model):
    from app.services import KeptCaches
    from backend.engine import GenerationSettings, prepare_comparison, resolve_methods

    def finished():
        comparison = prepare_comparison(*default_model, [{"role": "user", "content": "Name a colour."}],
                                        resolve_methods(["kitty"]), GenerationSettings(max_new_tokens=2))
        comparison.run()
        return comparison

    old, new = finished(), finished()
    one = old.held_bytes()
    kept = KeptCaches(max_bytes=one * 3 // 2)            # room for one comparison, not two
    kept.add(old)
    kept.add(new)
    assert old.released and old.held_bytes() == 0
    assert not new.released and kept.held_bytes() == new.held_bytes() == one > 0
    nothing = KeptCaches(max_bytes=0)                     # one comparison alone beyond the budget goes at once
    nothing.add(new)
    assert new.released and nothing.held_bytes() == 0
    assert Services(AppConfig(keep_cache_mb=3), None, None).kept.max_bytes == 3 * 2**20
