"""Bad input on the Compare tab gets a clear message in the page, never a stack trace; a broken database neither
costs the answers nor (once it is back) the history entry. These drive the tab's Send handler directly (the exact
function the button runs), with the tab built inside a gr.Blocks."""
from __future__ import annotations

import re
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
    session = CompareSession()
    session.history["fp16"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}] * 2
    outputs = {}
    for update in limited.send(session, "And now?", ["fp16"], *CUSTOM.values(), *GENERATION.values(), "",
                               "kitty", 10, 0, *[[] for _ in PANE_METHODS]):
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
    assert "1 of 2 answers complete; failed: kitty" in status_of(page, out)
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


class Tab:
    """One browser tab: its session and what its panes show, sent back with the next message as the page does."""

    def __init__(self, page):
        self.page, self.session = page, CompareSession()
        self.chats = {label: [] for label in PANE_METHODS}

    def _run(self, updates) -> dict:
        outputs = {}
        for update in updates:
            outputs.update(update)
        self.chats.update({label: outputs[chat] for label, chat in self.page.chats.items() if chat in outputs})
        return outputs

    def send(self, prompt, methods=("fp16", "kitty"), document="", blind=False, **generation):
        g = {**GENERATION, **generation}
        return self._run(self.page.send(self.session, prompt, list(methods), *CUSTOM.values(), *g.values(), "",
                                        "kitty", 10, 0, *self.chats.values(), document, blind))

    def regenerate(self) -> dict:
        return self._run(self.page.regenerate(self.session, "kitty", 10, 0, *self.chats.values()))


def test_a_second_turn_sends_each_method_its_own_history(page_for, monkeypatch):
    """The tab's session keeps what each method saw and wrote (a failed answer is not sent back); the panes only
    show it."""
    import backend.engine as engine
    from backend.engine import encode_chat
    page = page_for()
    tab = Tab(page)
    tab.send("Name a colour.", methods=("fp16", "kitty", "kivi-k2v2"))
    fp16_answer = tab.session.history["fp16"][-1]["content"]
    assert fp16_answer and fp16_answer == answer(page, {page.chats["fp16"]: tab.chats["fp16"]}, "fp16")
    tab.session.history["kitty"][-1]["content"] = "Red."              # as if kitty had answered otherwise
    real = engine.make_cache

    def make_cache(model, config):
        if config.name == "kivi-k2v2":
            raise RuntimeError("broken")
        return real(model, config)
    monkeypatch.setattr(engine, "make_cache", make_cache)
    outputs = tab.send("And another one?", methods=("fp16", "kitty", "kivi-k2v2"))
    tokenizer = page.services.models.default[1]
    jobs = tab.session.comparison._jobs
    for label, earlier in (("fp16", fp16_answer), ("kitty", "Red.")):
        expected = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": earlier},
                    {"role": "user", "content": "And another one?"}]
        assert jobs[label].input_ids.tolist() == encode_chat(tokenizer, expected).tolist()
        shown = outputs[page.chats[label]]
        assert [m["role"] for m in shown] == ["user", "assistant", "user", "assistant"]
        assert compare_tab._text(shown[-2]["content"]) == "And another one?"
    assert "broken" in answer(page, outputs, "kivi-k2v2")                # the pane shows the failure...
    assert [m["role"] for m in tab.session.history["kivi-k2v2"]] == ["user", "assistant", "user"]   # ...not sent


def test_regenerate_asks_again_with_the_same_settings_and_a_new_seed_when_sampling(page_for):
    page = page_for()
    tab = Tab(page)
    assert "Nothing to regenerate yet" in status_of(page, tab.regenerate())
    first = tab.send("Name a colour.")
    again = tab.regenerate()                                  # greedy: the very same answers, in place of the last
    for label in ("fp16", "kitty"):
        assert answer(page, again, label) == answer(page, first, label)
        assert [m["role"] for m in tab.chats[label]] == ["user", "assistant"]
        assert [m["role"] for m in tab.session.history[label]] == ["user", "assistant"]
    tab.send("Name an animal.", decoding="sample", seed=5)
    out = tab.regenerate()
    assert out[page.generation[5]] == 6 and tab.session.request.settings.seed == 6
    assert compare_tab._text(tab.chats["fp16"][-2]["content"]) == "Name an animal." and len(tab.chats["fp16"]) == 4


def test_stop_is_not_success_and_new_chat_starts_afresh(page_for):
    page = page_for()
    tab = Tab(page)
    outputs = {}
    for i, update in enumerate(page.send(tab.session, "Write a long story about a lighthouse.", ["fp16", "kitty"],
                                         *CUSTOM.values(), *{**GENERATION, "max_new_tokens": 200}.values(), "",
                                         "kitty", 10, 0, *tab.chats.values())):
        outputs.update(update)
        if i == 2:
            page.stop(tab.session)                            # the Stop button
    status = status_of(page, outputs)
    assert "kitty-stopped" in status and "kitty-ok" not in status and "Stopped: 0 of 2 answers complete" in status
    assert "cut short: fp16, kitty" in status
    cleared = page.new_chat(tab.session)
    assert all(cleared[chat] == [] for chat in page.chats.values())
    assert all("Run a comparison to see this plot" in str(cleared[figure].to_dict()) for figure in page.figures)
    assert tab.session.history == {} and tab.session.comparison is None and cleared[page.status] == ""


def test_a_document_is_sent_before_the_question_and_shown_folded(page_for, tmp_path):
    from app.compare_tab import read_document
    from backend.engine import InputError
    page = page_for(max_prompt_chars=2000)
    tab = Tab(page)
    out = tab.send("What is the colour of the door?", methods=("fp16",),
                   document="The door of the house is green.\n\nNobody knows why.")
    sent = tab.session.history["fp16"][0]["content"]
    assert sent == "The door of the house is green.\n\nNobody knows why.\n\nWhat is the colour of the door?"
    shown = compare_tab._text(out[page.chats["fp16"]][0]["content"])
    assert "<details" in shown and "document · 50 characters" in shown and shown.endswith("the door?")
    assert out[page.document] == "" and out[page.prompt] == ""
    out = tab.send("And now?", methods=("fp16",), document="x" * 1990)     # the same limit as the conversation
    assert "this server takes at most 2,000" in status_of(page, out)

    text = tmp_path / "notes.txt"
    text.write_text("Über die Brücke.\n")
    assert read_document(str(text), 2000) == "Über die Brücke.\n"
    for content, message in ((b"x" * 8001, "notes.bin is 8,001 bytes"), (b"\xff\xfe\x00\x01", "not a UTF-8 text"),
                             (b"ab\x00cd", "looks like a binary file"), (b"y" * 2001, "has 2,001 characters"),
                             (b"  \n", "is empty")):
        path = tmp_path / "notes.bin"
        path.write_bytes(content)
        with pytest.raises(InputError, match=message):
            read_document(str(path), 2000)
    document, status = page.load_document(str(path))
    assert "kitty-error" in status and "is empty" in status
    document, status = page.load_document(str(text))
    assert document == "Über die Brücke.\n" and "Loaded notes.txt (17 characters)" in status


def test_blind_mode_hides_the_methods_until_the_vote_which_is_stored(page_for, tmp_path):
    page = page_for()
    tab = Tab(page)
    methods = ("fp16", "kivi-k2v2", "kitty")
    out = tab.send("Name a colour.", methods=methods, blind=True)
    order = tab.session.run.order
    assert sorted(order) == sorted(methods)
    for label in methods:
        letter = "ABC"[order.index(label)]
        header = re.sub("<[^>]+>", " ", out[page.headers[label]])          # the text a visitor sees
        assert f"Answer {letter}" in header and label not in header
        assert "hidden until you vote" in out[page.metrics[label]] and "KV cache" not in out[page.metrics[label]]
        assert f"kitty-order-{order.index(label)}" in out[page.panes[label]]["elem_classes"]
    assert out[page.live_box]["visible"] is False and out[page.vote_box]["visible"] is True
    assert out[page.vote_choice]["choices"][:3] == [("A", "A"), ("B", "B"), ("C", "C")] or \
        [c if isinstance(c, str) else c[0] for c in out[page.vote_choice]["choices"]][:3] == ["A", "B", "C"]
    assert "Choose an answer" in page.vote(tab.session, None)[page.vote_status]

    voted = page.vote(tab.session, "B")
    assert f"Vote stored: B = {order[1]}" in voted[page.vote_status]
    assert all(label in re.sub("<[^>]+>", " ", voted[page.headers[label]]) for label in methods)   # revealed
    assert "KV cache" in voted[page.metrics["kitty"]] and voted[page.live_box]["visible"] is True
    assert "already voted" in page.vote(tab.session, "A")[page.vote_status]
    votes = page.services.runlog.database().votes(tab.session.run.slug)
    assert [(v.choice, v.blind, v.shown) for v in votes] == [(order[1], True, order)]
    board = {row.method: row for row in page.services.runlog.database().leaderboard()}
    assert board[order[1]].wins == 1 and all(board[m].votes == 1 for m in methods)


def test_history_messages_for_unknown_runs_and_export(default_model, tmp_path):
    from app import history_tab
    db_url = f"sqlite:///{tmp_path / 'runs.sqlite3'}"
    services = Services(AppConfig(db_url=db_url), ModelRegistry(loader=lambda name: default_model), RunLog(db_url))
    with gr.Blocks():
        compare = compare_tab.build(services)
        history = history_tab.build(services)
    slug = status_of(compare, send(compare)).split("Saved as run ")[1].split(".")[0]

    assert history.guide.value and "Click a run" in history.guide.value and history.run_box.visible is False
    view = dict(zip(history.view_outputs, history.open_run("nosuchrun1")))
    assert "No run &#x27;nosuchrun1&#x27; in this database" in view[history.message]
    assert view[history.guide]["visible"] is True and view[history.run_box]["visible"] is False
    view = dict(zip(history.view_outputs, history.open_run("")))
    assert "Type a run id" in view[history.message]
    view = dict(zip(history.view_outputs, history.open_run(slug)))
    assert f"Run {slug}" in view[history.header] and [row[0] for row in view[history.metrics]] == ["fp16", "kitty"]
    assert view[history.guide]["visible"] is False and view[history.run_box]["visible"] is True
    fp16_row, kitty_row = view[history.metrics]
    assert fp16_row[2] == "reference" and kitty_row[2].endswith("%") and float(kitty_row[3]) >= 0   # teacher-forced

    rows, message, _, _, board = history.search("kitty", "any", None, None)
    assert [row[0] for row in rows] == [slug] and "1 run(s)" in message
    assert [row[0] for row in board] == ["kitty"] and board[0][5] == 1           # one kitty answer scored
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

    session = CompareSession()                   # a run whose methods were stopped is listed as such, never "ok"
    for i, _ in enumerate(compare.send(session, "Tell a long story.", ["fp16", "kitty"], *CUSTOM.values(),
                                       *{**GENERATION, "max_new_tokens": 300}.values(), "", "kitty", 10, 0,
                                       *[[] for _ in PANE_METHODS])):
        if i == 2:
            compare.stop(session)
    rows, *_ = history.search("any", "any", None, None)
    assert rows[0][3] == "fp16 (stopped), kitty (stopped)" and rows[0][4] == "stopped"


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
