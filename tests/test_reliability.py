"""The service under bad input, faults and disconnects (issue 9), against the real server on a loopback port, a
real SQLite file and gradio_client: bounded sizes, a run log that waits for a locked or removed database instead
of dropping runs, a killed server's run left "interrupted", cancelled runs, no paths or URLs shown to visitors,
safe CSV, the model-loading policy, and clients that go away. Generations are a few tokens long; one test starts
a separate server process (the one it kills)."""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import gradio as gr
import httpx
import psutil
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from app import compare_tab, history_tab
from app.config import AppConfig
from app.runlog import RunLog
from app.services import ModelRegistry, Services
from backend.engine import MAX_METHODS
from storage import Database, StorageError

from test_app_api import free_port, serve_app

REPO = Path(__file__).resolve().parents[1]
SHORT = '{"max_new_tokens": 4}'
LONG_PROMPT = "Count from 1 to 500, one number per line, and say nothing else."


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    db_path = tmp_path_factory.mktemp("reliability") / "store" / "runs.sqlite3"
    with serve_app(default_model, db_path) as (url, services):
        yield url, db_path, services


@pytest.fixture(scope="module")
def client(server):
    return Client(server[0], verbose=False)


def stored(db_path: Path, slug: str, *, timeout: float = 30.0, until=lambda run: run.status != "running"):
    """The run as its database holds it once `until(run)` (the run log writes in the background), else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            run = Database(f"sqlite:///{db_path}").get_run(slug)
        except Exception:            # the folder is away, or the file is being recreated
            run = None
        if run is not None and until(run):
            return run
        time.sleep(0.2)
    return None


def assert_private(text: str, db_path: Path) -> None:
    """Nothing a visitor sees names the server's folders or the database URL."""
    assert str(db_path.parent) not in text and "sqlite:" not in text and "/tmp" not in text


# ---------------------------------------------------------------------------------------------- 1. sizes
def test_an_oversized_custom_request_is_refused_before_it_takes_memory(client):
    process = psutil.Process()
    before = process.memory_info().rss
    for sink in (40000, 10**9):
        with pytest.raises(AppError, match=f"sink={sink} is larger than the model's context of 8192 tokens"):
            client.predict("Hi", ["custom"], json.dumps({"custom": {"sink": sink, "k_bits": 16, "v_bits": 16},
                                                          "max_new_tokens": 4}), api_name="/compare")
    growth = process.memory_info().rss - before
    assert growth < 100 * 2**20, f"the server grew by {growth / 2**20:.0f} MB"


@pytest.mark.parametrize("prompt, methods, settings, limit", [
    ("Hi", ["custom"], {"custom": {"local_window": 9000, "alpha": 0}}, "local_window=9000 is larger than the "
                                                                        "model's context of 8192 tokens"),
    ("Hi", ["custom"], {"custom": {"page_size": 4096}}, "page_size=4096 is larger than the supported 1024 tokens"),
    ("Hi", ["fp16"], {"max_new_tokens": 10**6}, "Max new tokens must be between 1 and 1024 on this server"),
    ("cat " * 30000, ["fp16"], {}, "this server takes at most 100,000"),
    ("Hi", ["fp16"], {"history": [{"role": "user", "content": "a"}] * 300}, "The conversation has 301 messages; "
                                                                            "this server takes at most 200"),
    ("Hi", ["fp16"] * (MAX_METHODS + 1), {}, f"Choose at most {MAX_METHODS} methods per comparison"),
])
def test_every_size_a_user_sets_is_bounded(client, prompt, methods, settings, limit):
    with pytest.raises(AppError, match=limit):
        client.predict(prompt, methods, json.dumps(settings), api_name="/compare")


# ---------------------------------------------------------------------------------------------- 2. storage
def test_a_database_locked_for_10_s_loses_no_run(client, server):
    _, db_path, _ = server
    holder = sqlite3.connect(db_path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")                # another writer, for longer than the 5 s busy timeout
    locked_at = time.monotonic()
    try:
        result = client.predict("Name a colour.", ["fp16", "kitty"], SHORT, api_name="/compare")
        assert result["saved"] is False and "Not saved yet (the database is locked by another writer)" in \
            result["warning"]
        assert_private(result["warning"], db_path)
        assert all(answer["text"] for answer in result["results"].values())
        time.sleep(max(0.0, 10 - (time.monotonic() - locked_at)))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    run = stored(db_path, result["run_slug"])
    assert run is not None and run.status == "ok"
    assert {r.method: r.output_text for r in run.results} == {m: a["text"] for m, a in result["results"].items()}


def test_a_database_folder_removed_and_restored_loses_no_run(client, server, tmp_path):
    _, db_path, _ = server
    before = client.predict("Name a colour.", ["fp16"], SHORT, api_name="/compare")
    assert before["saved"] and stored(db_path, before["run_slug"]) is not None
    backup = tmp_path / "backup"
    shutil.copytree(db_path.parent, backup)
    shutil.rmtree(db_path.parent)
    try:
        during = client.predict("Name a fruit.", ["fp16", "kitty"], SHORT, api_name="/compare")
        assert during["saved"] is False and "Not saved yet (the database folder is missing)" in during["warning"]
        assert_private(during["warning"], db_path)
        assert all(answer["text"] for answer in during["results"].values())
    finally:
        shutil.copytree(backup, db_path.parent)      # the volume comes back, with the file as it was
    run = stored(db_path, during["run_slug"])
    assert run is not None and run.status == "ok" and [r.method for r in run.results] == ["fp16", "kitty"]
    assert stored(db_path, before["run_slug"]) is not None
    after = client.predict("Name a tree.", ["fp16"], SHORT, api_name="/compare")
    assert after["saved"] and after["warning"] is None


def _finish(runlog: RunLog, prompt: str):
    from backend.engine import GenerationSettings, MethodSnapshot
    from backend.methods import method_config
    run = runlog.begin("m", [{"role": "user", "content": prompt}], GenerationSettings(), ["fp16"])
    snaps = {"fp16": MethodSnapshot("fp16", method_config("fp16"), status="done", text="Blue.", token_ids=(1, 2))}
    return runlog.finish(run, snaps, "peak RSS")


def test_runs_wait_in_a_bounded_queue_and_a_refused_run_holds_up_nothing(tmp_path, monkeypatch):
    import app.runlog as runlog_module
    folder = tmp_path / "store"
    runlog = RunLog(f"sqlite:///{folder / 'runs.sqlite3'}")
    shutil.rmtree(folder)
    monkeypatch.setattr(runlog_module, "MAX_PENDING_RUNS", 2)
    outcomes = [_finish(runlog, f"question {i}") for i in range(3)]
    assert [(o.saved, o.waiting) for o in outcomes] == [(False, True), (False, True), (False, False)]
    assert outcomes[2].note == "The run was not saved (the database folder is missing; 2 runs wait for it)."
    folder.mkdir()                                  # back: the waiting runs are written, the refused one is not
    assert all(stored(folder / "runs.sqlite3", o.slug) is not None for o in outcomes[:2])
    assert Database(f"sqlite:///{folder / 'runs.sqlite3'}").get_run(outcomes[2].slug) is None

    save_run = Database.save_run

    def refuse_poison(db, entry):
        if entry.prompt == "poison":
            raise StorageError("CHECK constraint failed", "the database refused the run", transient=False)
        return save_run(db, entry)

    monkeypatch.setattr(Database, "save_run", refuse_poison)
    poison, fine = _finish(runlog, "poison"), _finish(runlog, "fine")
    assert (poison.saved, poison.waiting) == (False, False) and "refused the run" in poison.note
    assert fine.saved and stored(folder / "runs.sqlite3", fine.slug) is not None
    runlog.close()


def test_a_killed_server_leaves_an_interrupted_run(default_model, tmp_path):
    """SIGKILL mid-generation: the run recorded when it started is "interrupted" once the server is back."""
    db_path = tmp_path / "runs.sqlite3"
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--db-url", f"sqlite:///{db_path}"],
                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        job = Client(url, verbose=False).submit(LONG_PROMPT, ["fp16"], '{"max_new_tokens": 512}',
                                                api_name="/compare")
        running = None
        while running is None and time.monotonic() < deadline:
            runs = Database(f"sqlite:///{db_path}").list_runs() if db_path.exists() else []
            running = next((r for r in runs if r.status == "running"), None)
            time.sleep(0.1)
        assert running is not None and not job.done(), "the run was not recorded when it started"
        while not job.outputs() and time.monotonic() < deadline:      # it is generating
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert Database(f"sqlite:///{db_path}").get_run(running.slug).status == "running"
    with serve_app(default_model, db_path):                          # the restart
        run = stored(db_path, running.slug, timeout=15)
    assert run is not None and run.status == "interrupted" and run.results == []


# ---------------------------------------------------------------------------------------------- 3. leaks, validation
@pytest.mark.parametrize("settings, message", [
    ('{"max_new_tokens": NaN}', "NaN is not a number JSON allows"),
    ('{"max_new_tokens": Infinity}', "Infinity is not a number JSON allows"),
    ('{"temperature": 1e999}', "temperature must be a number"),
    ('{"max_new_tokens": 8.5}', "max_new_tokens must be a whole number"),
    ('{"max_new_tokens": ' + "9" * 5000 + "}", "settings must be a JSON object"),
    ('{"model": 123}', "The model must be a name"),
    ('{"seed": 1000000000000000000000000000000}', "seed must be a whole number from 0 to 4294967295"),
    ('{"custom": {"seed": -1}}', "seed=-1 must be a whole number from 0 to 4294967295"),
    ('{"custom": [1, 2]}', "its settings must be an object"),
])
def test_bad_values_get_a_clear_message(client, settings, message):
    methods = ["custom"] if "custom" in settings else ["fp16"]
    with pytest.raises(AppError, match=message):
        client.predict("Hi", methods, settings, api_name="/compare")


def test_bad_requests_of_other_types_get_a_clear_message(client):
    with pytest.raises(AppError, match="Methods must be a list of method names"):
        client.predict("Hi", "fp16", "{}", api_name="/compare")


def test_the_server_keeps_serving_after_bad_requests(client, server):
    result = client.predict("Name a colour.", ["fp16"], SHORT, api_name="/compare")
    assert result["saved"] and stored(server[1], result["run_slug"]).status == "ok"


def test_permalinks_that_are_no_run_id_get_a_message(server, default_model):
    _, db_path, services = server
    with gr.Blocks():
        history = history_tab.build(services)
    for slug in ("²", "9" * 5000, "1" * 19, "<script>", "../../etc"):
        view = dict(zip(history.view_outputs, history.open_run(slug)))
        assert "is not a run id" in view[history.message] or "No run" in view[history.message], slug
        assert Database(f"sqlite:///{db_path}").get_run(slug) is None
    assert Database(f"sqlite:///{db_path}").get_run(10**30) is None


def test_storage_warnings_in_the_history_keep_the_path_private(server, tmp_path):
    _, db_path, services = server
    folder = tmp_path / "gone"
    broken = Services(AppConfig(), services.models, RunLog(f"sqlite:///{folder / 'runs.sqlite3'}"))
    shutil.rmtree(folder)
    with gr.Blocks():
        history = history_tab.build(broken)
    rows, message, *_ = history.search("any", "any", None, None)
    assert rows == [] and "The history is unavailable: the database" in message
    view = dict(zip(history.view_outputs, history.open_run("aB3dE5gH7j")))
    assert "Could not open the run: the database" in view[history.message]
    _, export_message = history.export("any", "any", None, None)
    for text in (message, view[history.message], export_message):
        assert_private(text, folder / "runs.sqlite3")
    broken.runlog.close()


# ---------------------------------------------------------------------------------------------- 4. CSV
def test_csv_export_neutralizes_formulas_and_leaves_no_files(client, server, monkeypatch):
    _, _, services = server
    formula = '=HYPERLINK("http://evil.example","click")'
    result = client.predict(formula, ["fp16"], SHORT, api_name="/compare")
    with gr.Blocks():
        history = history_tab.build(services)
    monkeypatch.setattr(history_tab, "EXPORT_TTL_S", 0.0)
    first, _ = history.export("any", "any", None, None)
    rows = list(csv.DictReader(open(first["value"], encoding="utf-8")))
    prompts = [row["prompt"] for row in rows if row["slug"] == result["run_slug"]]
    assert prompts == ["'" + formula]
    second, _ = history.export("any", "any", None, None)
    assert not Path(first["value"]).exists() and Path(second["value"]).exists()
    assert os.listdir(Path(second["value"]).parent) == [Path(second["value"]).name]


# ---------------------------------------------------------------------------------------------- 5. models
def test_the_model_policy_refuses_local_paths_without_saying_what_exists(default_model, tmp_path):
    loaded = []

    def loader(name):
        if name is None:
            return default_model
        loaded.append(name)
        raise OSError(f"{name} is not a repository on the hub (cache at {tmp_path})")

    any_id = ModelRegistry(allow_any=True, loader=loader)
    for path in ("/etc", "../secrets", "~/.ssh", str(tmp_path)):
        with pytest.raises(Exception, match="is not a Hugging Face model id"):
            any_id.get(path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()          # a local folder shaped like a hub id...
    os.chdir(tmp_path)
    try:
        messages = {}
        for name in ("org/model", "org/absent"):   # ...fails exactly like an id the hub does not have
            with pytest.raises(Exception) as caught:
                any_id.get(name)
            messages[name] = str(caught.value).replace(name, "NAME")
    finally:
        os.chdir(REPO)
    assert messages["org/model"] == messages["org/absent"] and str(tmp_path) not in messages["org/model"]
    assert loaded == ["org/absent"]                # the local folder was never loaded

    listed = ModelRegistry(allowed=(str(tmp_path / "org" / "model"),), loader=loader)
    with pytest.raises(Exception, match="does not offer 'gpt2'"):
        listed.get("gpt2")
    with pytest.raises(Exception, match="Could not load the model"):
        listed.get(str(tmp_path / "org" / "model"))
    assert loaded[-1] == str(tmp_path / "org" / "model")


def test_models_load_without_remote_code(monkeypatch):
    import backend.model as model_module
    calls = []

    class Refuse:
        @staticmethod
        def from_pretrained(name, **kwargs):
            calls.append(kwargs)
            raise OSError("stop here")

    monkeypatch.setattr(model_module, "AutoModelForCausalLM", Refuse)
    with pytest.raises(OSError):
        model_module.load_model("org/model")
    assert calls and calls[0]["trust_remote_code"] is False


# ---------------------------------------------------------------------------------------------- 6. cancelling
def test_an_api_client_that_disconnects_cancels_its_generation(server):
    """A client that drops its connection mid-generation: the methods stop, as the page's Stop stops them, and
    the run is stored as "cancelled" with what they wrote."""
    url, db_path, _ = server
    config = httpx.get(url + "config", timeout=10).json()
    fn_index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "compare")
    session = uuid.uuid4().hex
    joined = httpx.post(url + "gradio_api/queue/join", timeout=10, json={
        "data": [LONG_PROMPT, ["fp16"], '{"max_new_tokens": 512}'], "fn_index": fn_index, "session_hash": session})
    assert joined.status_code == 200
    slug = None
    with httpx.stream("GET", url + "gradio_api/queue/data", params={"session_hash": session}, timeout=60) as stream:
        for line in stream.iter_lines():
            message = json.loads(line[5:]) if line.startswith("data:") else {}
            if message.get("msg") == "process_generating":
                slug = message["output"]["data"][0]["run_slug"]
                break
    dropped = time.monotonic()                     # the connection closed with the stream
    assert slug is not None
    run = stored(db_path, slug, timeout=60)
    assert run is not None and run.status == "cancelled", run
    assert 0 < run.results[0].n_tokens < 512 and run.results[0].metrics["status"] == "stopped"
    assert time.monotonic() - dropped < 30


def test_a_page_closed_mid_run_is_cancelled_and_stop_is_stopped(server, monkeypatch):
    _, db_path, services = server
    with gr.Blocks():
        page = compare_tab.build(services)
    started = []
    begin = services.runlog.begin
    monkeypatch.setattr(services.runlog, "begin", lambda *args: started.append(begin(*args)) or started[-1])
    inputs = dict(k_bits=2, v_bits=2, alpha=0.125, sink=32, page_size=128, window=128, selection="magnitude",
                  max_new_tokens=512, decoding="greedy", temperature=0.7, top_p=0.95, top_k=50, seed=0)
    chats = [[] for _ in compare_tab.PANE_METHODS]

    closed = compare_tab.CompareSession()
    updates = page.send(closed, LONG_PROMPT, ["fp16"], *inputs.values(), "", "kitty", 10, 0, *chats)
    next(updates), next(updates)                    # it runs...
    updates.close()                                 # ...and the tab goes away (Gradio closes the handler)
    run = stored(db_path, started[0].slug)
    assert run.status == "cancelled" and run.results[0].n_tokens < 512

    stopped = compare_tab.CompareSession()
    outputs = {}
    for i, update in enumerate(page.send(stopped, LONG_PROMPT, ["fp16"], *inputs.values(), "", "kitty", 10, 0,
                                         *chats)):
        outputs.update(update)
        if i == 2:
            page.stop(stopped)                      # the Stop button
    status = outputs[page.status]
    assert "Saved as run" in status
    run = stored(db_path, status.split("?run=")[1].split('"')[0])
    assert run.status == "stopped" and run.results[0].n_tokens < 512

