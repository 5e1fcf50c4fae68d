"""The JSON API through gradio_client, against the real server on 127.0.0.1 and a free port, with the run log in a
temporary SQLite file (KITTY_DB_URL). `serve_app` is also used by the browser tests."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.analysis import bundled_text
from storage import Database


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(model_and_tokenizer, db_path: Path, **settings) -> Iterator[tuple[str, object]]:
    """The whole app served in this process (on the already loaded model): yields (url, services)."""
    from app.config import AppConfig
    from app.runlog import RunLog
    from app.server import build_app, launch
    from app.services import ModelRegistry, Services

    db_url = f"sqlite:///{db_path}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KITTY_DB_URL", db_url)          # the run log finds its database the way an operator sets it
        env.setenv("GRADIO_ANALYTICS_ENABLED", "False")
        config = AppConfig(host="127.0.0.1", port=free_port(), **settings)
        services = Services(config, ModelRegistry(loader=lambda name: model_and_tokenizer), RunLog())
        demo = build_app(services)
        launch(demo, config, prevent_thread_lock=True, quiet=True)
        try:
            yield f"http://127.0.0.1:{config.port}/", services
        finally:
            demo.close()


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    db_path = tmp_path_factory.mktemp("api") / "runs.sqlite3"
    with serve_app(default_model, db_path) as (url, services):
        yield url, db_path


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client
    return Client(server[0], verbose=False)


# Long enough (about 200 tokens) that each cache forms a key page: Kitty then has boost masks to store
PROMPT = "Summarize this text in one sentence:\n\n" + bundled_text()[:700]


def test_compare_endpoint_returns_answers_and_metrics_and_logs_the_run(client, server):
    result = client.predict(PROMPT, ["fp16", "kivi-k2v2", "kitty"], '{"max_new_tokens": 16}', api_name="/compare")
    assert set(result["results"]) == {"fp16", "kivi-k2v2", "kitty"}
    assert result["warning"] is None and result["model"] == "SmolLM2-135M-Instruct"
    for answer in result["results"].values():
        assert answer["status"] == "done" and answer["error"] is None
        assert answer["text"].strip() and 1 <= answer["n_tokens"] <= 16
        assert answer["n_tokens"] == len(answer["token_ids"])
        assert answer["tokens_per_s"] > 0 and answer["ttft_s"] > 0 and answer["kv_bytes"] > 0
        assert answer["kv_ratio"] == pytest.approx(answer["kv_bytes"] / answer["fp16_bytes"])
        assert 0 <= answer["agreement"] <= 1
    assert result["results"]["fp16"]["agreement"] == 1.0
    assert result["results"]["kitty"]["key_pages"] > 0
    # Scored by teacher forcing (FP16's answer fed through each cache) before the answer comes back
    assert result["results"]["fp16"]["score_status"] == "reference"
    for method in ("kivi-k2v2", "kitty"):
        answer = result["results"][method]
        assert answer["score_status"] == "scored" and answer["scored_tokens"] == result["results"]["fp16"]["n_tokens"]
        assert 0 <= answer["top1_agreement"] <= 1 and answer["kl_from_fp16"] > 0
    assert result["permalink"] == f"/?run={result['run_slug']}"

    run = Database(f"sqlite:///{server[1]}").get_run(result["run_slug"])
    assert run is not None and run.status == "ok" and run.model == "SmolLM2-135M-Instruct"
    assert run.prompt == PROMPT.strip() and run.settings["generation"]["max_new_tokens"] == 16
    stored = {r.method: r for r in run.results}
    assert list(stored) == ["fp16", "kivi-k2v2", "kitty"]
    for method, answer in result["results"].items():
        assert stored[method].output_text == answer["text"]
        assert stored[method].token_ids == answer["token_ids"]
        assert stored[method].kv_bytes == answer["kv_bytes"]
        assert stored[method].agreement == pytest.approx(answer["agreement"])
        assert stored[method].metrics["timeline"]
        assert stored[method].kl_from_fp16 == (None if method == "fp16" else pytest.approx(answer["kl_from_fp16"]))
        assert stored[method].metrics["score_status"] == answer["score_status"]
    # Page stats of the Kitty method: every layer x KV head x page of sequence 0, 8 of 64 channels boosted
    stats = stored["kitty"].page_stats
    pages = result["results"]["kitty"]["key_pages"] // 30
    assert len(stats) == 30 * 3 * pages
    assert {(s.layer, s.head, s.page) for s in stats} == {(layer, head, page) for layer in range(30)
                                                          for head in range(3) for page in range(pages)}
    assert all(sum(s.boost_mask) == 8 and len(s.magnitudes) == 64 for s in stats)
    assert stored["fp16"].page_stats == [] and stored["kivi-k2v2"].page_stats == []


def test_compare_endpoint_reports_bad_requests(client):
    from gradio_client.exceptions import AppError
    with pytest.raises(AppError, match="prompt is empty"):
        client.predict("   ", ["fp16"], "{}", api_name="/compare")
    with pytest.raises(AppError, match="Max new tokens must be between 1 and 1024"):
        client.predict("Hi", ["fp16"], '{"max_new_tokens": 5000}', api_name="/compare")
    with pytest.raises(AppError, match="Custom method: selection='loudest'"):
        client.predict("Hi", ["custom"], '{"custom": {"selection": "loudest"}}', api_name="/compare")
    with pytest.raises(AppError, match="only serves SmolLM2-135M-Instruct"):
        client.predict("Hi", ["fp16"], '{"model": "gpt2"}', api_name="/compare")
    with pytest.raises(AppError, match="JSON object"):
        client.predict("Hi", ["fp16"], "max_new_tokens=3", api_name="/compare")


def test_api_lists_only_the_compare_endpoint(client):
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert list(endpoints) == ["/compare"]


def test_a_long_comparison_does_not_hold_up_a_short_one(client):
    """Comparisons run side by side (compare_concurrency=2): a second user is not stuck behind a long answer."""
    import time

    long_job = client.submit("Write a long story about a dragon who collects teapots.", ["fp16"],
                             '{"max_new_tokens": 64}', api_name="/compare")
    deadline = time.monotonic() + 60
    while not long_job.outputs() and time.monotonic() < deadline:      # its first tokens streamed back
        time.sleep(0.05)
    assert long_job.outputs() and not long_job.outputs()[0]["finished"]
    short = client.predict("Say hi.", ["fp16"], '{"max_new_tokens": 2}', api_name="/compare")
    assert not long_job.done(), "the short request waited for the long one"
    assert 1 <= short["results"]["fp16"]["n_tokens"] <= 2
    assert long_job.result(timeout=180)["results"]["fp16"]["n_tokens"] > 2
