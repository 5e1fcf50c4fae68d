"""Tests for the storage package: round trips, transactions, concurrency, settings,
schema versioning and error reporting. All databases live under tmp_path."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import multiprocessing
import shutil
import socket
import sqlite3
import struct
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select, text, update

from storage import VOTE_TIE, CSV_COLUMNS, Database, MethodResult, PageStat, RunEntry, StorageError, resolve_url
from storage.codec import pack_mask, unpack_mask
from storage.db import alembic_config, head_revision
from storage.models import Base, MethodResultRow, PageStatRow, RunRow, VoteRow

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a cat."},
    {"role": "assistant", "content": "Kitty."},
    {"role": "user", "content": "Another one?"},
]
SETTINGS = {"max_new_tokens": 32, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 1234}


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "kitty.sqlite3"


@pytest.fixture
def db(db_path: Path):
    database = Database(_url(db_path)).init()
    yield database
    database.close()


def _page_stats(n_layers: int = 2, n_heads: int = 2, head_dim: int = 12) -> list[PageStat]:
    stats = []
    for layer in range(n_layers):
        for head in range(n_heads):
            for page in range(2):
                seed = layer * 100 + head * 10 + page
                stats.append(
                    PageStat(
                        layer=layer,
                        head=head,
                        page=page,
                        boost_mask=[(seed + c) % 3 == 0 for c in range(head_dim)],
                        magnitudes=[0.1 * (seed + c) + 1 / 3 for c in range(head_dim)],
                    )
                )
    return stats


def _kitty_result(**overrides) -> MethodResult:
    values = dict(
        method="kitty",
        config={"k_bits": 2, "v_bits": 2, "sink": 4, "page_size": 128, "local_window": 32, "alpha": 0.25,
                "selection": "magnitude"},
        output_text="Whiskers, maybe.",
        token_ids=[5, 17, 42, 9000],
        n_tokens=4,
        tokens_per_s=31.5,
        ttft_s=0.125,
        total_s=0.25,
        kv_bytes=123_456_789_012,
        fp16_bytes=987_654_321_098,
        key_bits=2.25,
        value_bits=2.0,
        peak_memory_bytes=3_000_000_000,
        agreement=0.75,
        metrics={"prefill_s": 0.05, "notes": ["a", "b"]},
        page_stats=_page_stats(),
    )
    values.update(overrides)
    return MethodResult(**values)


def _fp16_dict() -> dict:
    return {"method": "fp16", "output_text": "Whiskers.", "token_ids": [5, 17], "n_tokens": 2, "tokens_per_s": 40.0}


def _record_simple(db: Database, tag: str, **kwargs):
    return db.record_run("tiny-model", f"prompt {tag}", [{"role": "user", "content": tag}], {"seed": 1},
                         [{"method": "fp16", "output_text": tag, "token_ids": [1], "n_tokens": 1}], **kwargs)


def _count(db: Database, row_type) -> int:
    with db.engine.connect() as conn:
        return conn.scalar(select(func.count()).select_from(row_type))


def _assert_results_equal(actual: MethodResult, expected: MethodResult) -> None:
    assert dataclasses.replace(actual, page_stats=[]) == dataclasses.replace(expected, page_stats=[])
    assert len(actual.page_stats) == len(expected.page_stats)
    for got, want in zip(actual.page_stats, expected.page_stats):
        assert (got.layer, got.head, got.page) == (want.layer, want.head, want.page)
        assert got.boost_mask == want.boost_mask
        assert all(type(flag) is bool for flag in got.boost_mask)
        # Stored as float32: equal to the float32 rounding of the input.
        want_f32 = list(struct.unpack(f"<{len(want.magnitudes)}f", struct.pack(f"<{len(want.magnitudes)}f",
                                                                                  *want.magnitudes)))
        assert got.magnitudes == want_f32
        assert got.magnitudes == pytest.approx(want.magnitudes, rel=1e-6)


# --- round trips ---------------------------------------------------------------


def test_run_results_and_page_stats_round_trip(db: Database) -> None:
    kitty = _kitty_result()
    record = db.record_run("llama-tiny", "Another one?", MESSAGES, SETTINGS, [_fp16_dict(), kitty])

    assert len(record.slug) == 10 and record.slug.isalnum()
    assert record.created_at.tzinfo is timezone.utc
    assert abs(datetime.now(timezone.utc) - record.created_at) < timedelta(minutes=1)
    assert record.status == "ok"

    detail = db.get_run(record.slug)
    assert detail is not None
    assert (detail.id, detail.slug, detail.created_at) == (record.id, record.slug, record.created_at)
    assert (detail.model, detail.prompt, detail.status) == ("llama-tiny", "Another one?", "ok")
    assert detail.messages == MESSAGES
    assert detail.settings == SETTINGS
    assert [r.method for r in detail.results] == ["fp16", "kitty"]
    _assert_results_equal(detail.results[0], MethodResult.coerce(_fp16_dict()))
    _assert_results_equal(detail.results[1], kitty)
    assert _count(db, PageStatRow) == len(kitty.page_stats)


def test_page_stats_can_be_skipped(db: Database) -> None:
    record = db.record_run("m", "p", MESSAGES, SETTINGS, [_kitty_result()])
    detail = db.get_run(record.slug, with_page_stats=False)
    assert detail is not None
    assert detail.results[0].page_stats == []
    assert detail.results[0].output_text == "Whiskers, maybe."


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 64, 128, 129])
def test_mask_packing_round_trips_any_length(length: int) -> None:
    mask = [(i * 7) % 5 < 2 for i in range(length)]
    packed = pack_mask(mask)
    assert len(packed) == (length + 7) // 8
    assert unpack_mask(packed, length) == mask


def test_in_memory_database_works() -> None:
    db = Database("sqlite://").init()
    record = _record_simple(db, "mem")
    assert db.get_run(record.id).prompt == "prompt mem"
    assert db.schema_revision() == head_revision()


# --- failures inside a run -------------------------------------------------------


def test_failed_method_is_stored_while_others_land(db: Database) -> None:
    failed = MethodResult(method="kivi-k2v2", error="CUDA out of memory", config={"k_bits": 2})
    record = db.record_run("m", "p", MESSAGES, SETTINGS, [_fp16_dict(), failed, _kitty_result()])
    assert record.status == "partial"

    detail = db.get_run(record.slug)
    by_method = {r.method: r for r in detail.results}
    assert by_method["kivi-k2v2"].error == "CUDA out of memory"
    assert by_method["kivi-k2v2"].output_text == "" and by_method["kivi-k2v2"].token_ids == []
    assert by_method["fp16"].error is None and by_method["fp16"].output_text == "Whiskers."
    assert by_method["kitty"].error is None and len(by_method["kitty"].page_stats) == 8

    all_failed = db.record_run("m", "p", MESSAGES, SETTINGS, [failed])
    assert all_failed.status == "failed"


def test_failed_transaction_writes_nothing(db: Database) -> None:
    _record_simple(db, "before")
    counts = [_count(db, table) for table in (RunRow, MethodResultRow, PageStatRow)]

    stats = _page_stats()
    stats[-1] = dataclasses.replace(stats[-1], layer=None)  # NOT NULL violation in the very last row
    with pytest.raises(StorageError, match="NOT NULL") as caught:
        db.record_run("m", "doomed", MESSAGES, SETTINGS, [_fp16_dict(), _kitty_result(page_stats=stats)])
    assert not caught.value.transient  # a retry cannot help: the run itself is refused

    assert [_count(db, table) for table in (RunRow, MethodResultRow, PageStatRow)] == counts
    assert [run.prompt for run in db.list_runs()] == ["prompt before"]


def test_deleting_a_run_cascades(db: Database) -> None:
    record = db.record_run("m", "p", MESSAGES, SETTINGS, [_kitty_result()])
    assert _count(db, PageStatRow) > 0
    with db.engine.begin() as conn:
        conn.execute(RunRow.__table__.delete().where(RunRow.id == record.id))
    assert (_count(db, MethodResultRow), _count(db, PageStatRow)) == (0, 0)


# --- votes and the leaderboard ------------------------------------------------


def _scored_run(db: Database, kl: float, top1: float, model: str = "m"):
    """fp16 (the reference: no score of its own) and kitty, scored by teacher forcing."""
    return db.record_run(model, "p", MESSAGES, SETTINGS, [
        _fp16_dict(), _kitty_result(page_stats=[], kl_from_fp16=kl, top1_agreement=top1, first_difference=3)])


def test_votes_are_stored_with_their_run_and_add_up_in_the_leaderboard(db: Database) -> None:
    first, second = _scored_run(db, kl=0.1, top1=0.9), _scored_run(db, kl=0.3, top1=0.7)
    _scored_run(db, kl=9.0, top1=0.0, model="other")                  # another model's run: left out below
    vote = db.add_vote(first.slug, "kitty", blind=True, shown=["kitty", "fp16"])
    assert (vote.run_slug, vote.choice, vote.blind, vote.shown) == (first.slug, "kitty", True, ["kitty", "fp16"])
    db.add_vote(first.slug, "fp16", blind=False, shown=["fp16", "kitty"])
    db.add_vote(second.slug, VOTE_TIE, blind=True, shown=["fp16", "kitty"])
    assert [v.choice for v in db.votes(first.slug)] == ["kitty", "fp16"] and db.votes("nosuchrun1") == []

    board = {row.method: row for row in db.leaderboard(model="m")}
    kitty, fp16 = board["kitty"], board["fp16"]
    assert (kitty.votes, kitty.wins, kitty.ties, kitty.win_rate) == (3, 1, 1, pytest.approx(1 / 3))
    assert (fp16.votes, fp16.wins, fp16.ties) == (3, 1, 1)
    assert kitty.scored == 2 and kitty.kl_from_fp16 == pytest.approx(0.2)
    assert kitty.top1_agreement == pytest.approx(0.8)
    assert fp16.scored == 0 and fp16.kl_from_fp16 is None           # the reference is not scored against itself
    assert {row.method: row.scored for row in db.leaderboard()}["kitty"] == 3   # every model

    stored = db.get_run(first.slug).results[1]
    assert (stored.kl_from_fp16, stored.top1_agreement, stored.first_difference) == (0.1, 0.9, 3)
    with db.engine.begin() as conn:                                   # votes go with their run
        conn.execute(RunRow.__table__.delete().where(RunRow.id == first.id))
    assert _count(db, VoteRow) == 1


def test_a_vote_needs_a_stored_run_and_one_of_its_methods(db: Database) -> None:
    record = _scored_run(db, kl=0.1, top1=0.9)
    with pytest.raises(StorageError, match="no run") as caught:
        db.add_vote("nosuchrun1", "kitty", blind=False, shown=[])
    assert caught.value.reason == "the run is not saved yet" and caught.value.transient
    with pytest.raises(StorageError, match="not a method of run") as caught:
        db.add_vote(record.slug, "kivi-k2v2", blind=False, shown=[])
    assert not caught.value.transient
    assert _count(db, VoteRow) == 0


# --- a run's life: started, finished, interrupted ------------------------------


def _entry(slug: str = "aaaaaaaaa1", **changes) -> RunEntry:
    values = dict(slug=slug, model="m", prompt="Another one?", messages=MESSAGES, settings=SETTINGS,
                  created_at=datetime.now(timezone.utc))
    return RunEntry(**{**values, **changes})


def test_a_run_is_recorded_when_it_starts_and_completed_when_it_ends(db: Database) -> None:
    started = _entry()
    record = db.save_run(started)
    assert record.status == "running" and db.get_run(started.slug).results == []

    finished = dataclasses.replace(started, status=None, results=[_fp16_dict(), _kitty_result()],
                                   finished_at=datetime.now(timezone.utc))
    for _ in range(2):  # a retried write stores the run once
        assert db.save_run(finished).id == record.id
    detail = db.get_run(started.slug)
    assert detail.status == "ok" and [r.method for r in detail.results] == ["fp16", "kitty"]
    counts = [_count(db, table) for table in (RunRow, MethodResultRow, PageStatRow)]
    assert counts == [1, 2, len(_kitty_result().page_stats)]

    assert db.save_run(started).status == "ok"  # a late "started" never undoes the end
    stopped = dataclasses.replace(finished, status="stopped", results=[_fp16_dict()])
    assert db.save_run(stopped).status == "stopped"  # a later state replaces the results, page stats included
    assert [_count(db, table) for table in (RunRow, MethodResultRow, PageStatRow)] == [1, 1, 0]


def test_runs_whose_server_died_become_interrupted(db: Database) -> None:
    def writer(owner: str) -> Database:
        other = Database(db.url)
        other.owner = owner
        return other

    db.save_run(_entry("alive00001"))  # this process, still running
    db.save_run(_entry("kept000001"))  # this process, silent for long but still generating (keep)
    writer(f"{socket.gethostname()}:4194305:1.00").save_run(_entry("dead000001"))  # beyond Linux's pid_max
    writer("another-host:1:1.00").save_run(_entry("quiet00001"))  # another host, silent for long
    writer("another-host:1:1.00").save_run(_entry("beats00001"))  # another host, silent for long, then beats
    with db.engine.begin() as conn:
        conn.execute(
            update(RunRow)
            .where(RunRow.slug.in_(["kept000001", "quiet00001", "beats00001"]))
            .values(heartbeat_at=datetime.now(timezone.utc) - timedelta(minutes=5))
        )
    db.touch_runs(["beats00001"])

    assert sorted(db.mark_interrupted(timedelta(minutes=2), keep=["kept000001"])) == ["dead000001", "quiet00001"]
    statuses = {run.slug: run.status for run in db.list_runs()}
    assert statuses == {"alive00001": "running", "kept000001": "running", "beats00001": "running",
                        "dead000001": "interrupted", "quiet00001": "interrupted"}
    assert db.get_run("dead000001").results == []
    assert db.mark_interrupted(timedelta(minutes=2), keep=["kept000001"]) == []


def test_json_columns_hold_standard_json(db: Database, db_path: Path) -> None:
    record = db.record_run("m", "p", MESSAGES, {"temperature": float("nan"), "top_p": [float("inf"), 0.5]},
                           [MethodResult("fp16", metrics={"tokens_per_s": float("-inf")})])
    with sqlite3.connect(db_path) as raw:
        settings, = raw.execute("SELECT settings FROM runs WHERE id = ?", (record.id,)).fetchone()
    assert json.loads(settings, parse_constant=lambda c: pytest.fail(f"{c} in stored JSON")) == \
        {"temperature": None, "top_p": [None, 0.5]}
    assert db.get_run(record.slug).results[0].metrics == {"tokens_per_s": None}


def test_a_schema_at_0002_is_upgraded_with_its_runs_unscored(db_path: Path) -> None:
    db = Database(_url(db_path)).init()
    record = _record_simple(db, "before votes")
    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0002")
    assert "votes" not in inspect(db.engine).get_table_names()
    db.init()
    result = db.get_run(record.slug).results[0]
    assert result.output_text == "before votes" and result.kl_from_fp16 is None and result.top1_agreement is None
    assert db.add_vote(record.slug, "fp16", blind=False, shown=["fp16"]).choice == "fp16"


def test_a_schema_at_0001_is_upgraded_with_its_runs(db_path: Path) -> None:
    db = Database(_url(db_path)).init()
    record = _record_simple(db, "old run")
    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0001")
    assert "owner" not in {c["name"] for c in inspect(db.engine).get_columns("runs")}
    db.init()
    assert db.get_run(record.slug).status == "ok" and db.mark_interrupted(timedelta(minutes=2)) == []


# --- concurrency -------------------------------------------------------------


def test_concurrent_threads_lose_nothing(db: Database) -> None:
    n_threads, n_runs = 4, 15
    errors: list[BaseException] = []

    def writer(thread: int) -> None:
        try:
            for i in range(n_runs):
                db.record_run("m", f"t{thread}-{i}", MESSAGES, SETTINGS, [_kitty_result()])
        except BaseException as exc:  # surfaced below; a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    runs = db.list_runs(limit=1000)
    assert sorted(run.prompt for run in runs) == sorted(f"t{t}-{i}" for t in range(n_threads) for i in range(n_runs))
    assert len({run.slug for run in runs}) == n_threads * n_runs
    assert _count(db, PageStatRow) == n_threads * n_runs * len(_page_stats())


def _write_runs_in_process(url: str, tag: str, n_runs: int) -> None:
    # Runs in a spawned child: its own engine, and it races the sibling on init too.
    db = Database(url).init()
    for i in range(n_runs):
        _record_simple(db, f"{tag}-{i}")


def test_concurrent_processes_lose_nothing(db_path: Path) -> None:
    url, n_runs = _url(db_path), 10
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_runs_in_process, args=(url, tag, n_runs)) for tag in ("a", "b")]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0]

    prompts = sorted(run.prompt for run in Database(url).list_runs(limit=1000))
    assert prompts == sorted(f"prompt {tag}-{i}" for tag in ("a", "b") for i in range(n_runs))


# --- queries -------------------------------------------------------------------


@pytest.fixture
def history(db: Database):
    """Four runs on known dates, models and methods."""
    day = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
    specs = [
        ("model-a", ["fp16", "kitty"], day),
        ("model-a", ["fp16", "kivi-k2v2"], day + timedelta(days=1)),
        ("model-b", ["kitty-pro"], day + timedelta(days=2)),
        ("model-b", ["fp16", "kitty"], day + timedelta(days=3)),
    ]
    records = [
        db.record_run(model, f"{model} {methods}", MESSAGES, SETTINGS,
                      [MethodResult(method=m, output_text=m, tokens_per_s=10.0) for m in methods], created_at=when)
        for model, methods, when in specs
    ]
    return db, records, day


def test_list_runs_newest_first_with_filters(history) -> None:
    db, records, day = history
    ids = [r.id for r in records]

    all_runs = db.list_runs()
    assert [r.id for r in all_runs] == ids[::-1]
    assert all_runs[0].methods == ["fp16", "kitty"]
    assert all_runs[0].created_at == day + timedelta(days=3)

    assert [r.id for r in db.list_runs(method="kitty")] == [ids[3], ids[0]]
    assert [r.id for r in db.list_runs(model="model-b")] == [ids[3], ids[2]]
    assert [r.id for r in db.list_runs(model="model-a", method="kivi-k2v2")] == [ids[1]]
    # Bounds are inclusive; naive datetimes count as UTC; aware ones in any zone work.
    assert [r.id for r in db.list_runs(since=day + timedelta(days=1), until=day + timedelta(days=2))] == [ids[2], ids[1]]
    assert [r.id for r in db.list_runs(since=datetime(2024, 5, 3, 12, 0))] == [ids[3], ids[2]]
    plus_two = timezone(timedelta(hours=2))
    assert [r.id for r in db.list_runs(until=datetime(2024, 5, 1, 14, 0, tzinfo=plus_two))] == [ids[0]]
    assert [r.id for r in db.list_runs(limit=2, offset=1)] == [ids[2], ids[1]]
    assert db.list_runs(method="custom") == []


def test_summary_prompt_is_truncated(db: Database) -> None:
    db.record_run("m", "x" * 1000, MESSAGES, SETTINGS, [])
    prompt = db.list_runs()[0].prompt
    assert len(prompt) == 200 and prompt.endswith("…")


def test_distinct_models_and_methods(history) -> None:
    db, _, _ = history
    assert db.distinct_models() == ["model-a", "model-b"]
    assert db.distinct_methods() == ["fp16", "kitty", "kitty-pro", "kivi-k2v2"]


def test_ids_that_are_not_plain_numbers_find_nothing(db: Database) -> None:
    record = _record_simple(db, "one")
    assert record.id == 1
    for key in ("²", "¹", "1" * 5000, "0" * 19 + "1", 10**30, -1):  # no ValueError, no overflow
        assert db.get_run(key) is None, key
    assert db.get_run("1").slug == record.slug


def test_permalink_by_slug_and_id(history) -> None:
    db, records, _ = history
    record = records[1]
    assert db.get_run(record.slug).id == record.id
    assert db.get_run(record.id).slug == record.slug
    assert db.get_run(str(record.id)).slug == record.slug
    assert db.get_run("nosuchslug") is None
    assert db.get_run(10_000) is None


def test_empty_database_reads(db: Database) -> None:
    assert db.list_runs() == []
    assert db.distinct_models() == [] and db.distinct_methods() == []
    assert db.get_run("anything") is None
    out = io.StringIO()
    assert db.export_csv(out) == 0
    assert list(csv.reader(io.StringIO(out.getvalue()))) == [list(CSV_COLUMNS)]


# --- CSV -------------------------------------------------------------------------


def test_export_csv_one_row_per_result(db: Database, tmp_path: Path) -> None:
    failed = MethodResult(method="custom", error="bad config")
    record = db.record_run("model-a", "Another one?", MESSAGES, SETTINGS, [_fp16_dict(), _kitty_result(), failed])
    target = tmp_path / "export.csv"

    assert db.export_csv(target) == 3
    with target.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        rows = list(reader)

    assert [row["method"] for row in rows] == ["fp16", "kitty", "custom"]
    assert {row["slug"] for row in rows} == {record.slug}
    kitty = rows[1]
    assert kitty["run_id"] == str(record.id)
    assert datetime.fromisoformat(kitty["created_at"]) == record.created_at
    assert kitty["model"] == "model-a" and kitty["prompt"] == "Another one?"
    assert float(kitty["tokens_per_s"]) == 31.5 and int(kitty["kv_bytes"]) == 123_456_789_012
    assert float(kitty["agreement"]) == 0.75 and kitty["n_tokens"] == "4"
    assert json.loads(kitty["config"])["page_size"] == 128
    assert json.loads(kitty["settings"]) == SETTINGS
    assert json.loads(kitty["metrics"]) == {"prefill_s": 0.05, "notes": ["a", "b"]}
    assert kitty["error"] == "" and kitty["output_text"] == "Whiskers, maybe."
    assert rows[2]["error"] == "bad config" and rows[2]["tokens_per_s"] == ""


def test_export_csv_neutralizes_formulas(db: Database) -> None:
    formulas = ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "\t=1", "\r=1"]
    for text in formulas:
        db.record_run("=cmd|' /C calc'!A0", text, MESSAGES, SETTINGS,
                      [{"method": "fp16", "output_text": text, "error": "=1+1"}])
    db.record_run("m", "a = b - c", MESSAGES, SETTINGS, [{"method": "fp16", "output_text": "fine"}])
    out = io.StringIO()
    db.export_csv(out)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [row["prompt"] for row in rows] == ["a = b - c"] + ["'" + text for text in reversed(formulas)]
    assert all(row["output_text"] == row["prompt"] for row in rows[1:]) and rows[0]["output_text"] == "fine"
    assert {row["model"] for row in rows[1:]} == {"'=cmd|' /C calc'!A0"} and rows[1]["error"] == "'=1+1"


def test_export_csv_filters(history) -> None:
    db, records, day = history
    out = io.StringIO()
    assert db.export_csv(out, method="kitty") == 2
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [(row["run_id"], row["method"]) for row in rows] == [(str(records[3].id), "kitty"), (str(records[0].id), "kitty")]

    out = io.StringIO()
    assert db.export_csv(out, model="model-a", since=day + timedelta(hours=1)) == 2
    assert {row["run_id"] for row in csv.DictReader(io.StringIO(out.getvalue()))} == {str(records[1].id)}


# --- settings and SQLite configuration --------------------------------------------


def test_env_url_wins_over_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KITTY_DB_URL", _url(tmp_path / "from_url.sqlite3"))
    monkeypatch.setenv("KITTY_DB_PATH", str(tmp_path / "from_path.sqlite3"))
    Database().init()
    assert (tmp_path / "from_url.sqlite3").exists()
    assert not (tmp_path / "from_path.sqlite3").exists()

    monkeypatch.delenv("KITTY_DB_URL")
    assert resolve_url() == _url(tmp_path / "from_path.sqlite3")


def test_default_path_is_under_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KITTY_DB_URL", raising=False)
    monkeypatch.delenv("KITTY_DB_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    db = Database().init()
    _record_simple(db, "default")
    assert (tmp_path / "data" / "kitty_lab.sqlite3").is_file()
    assert resolve_url({}) == _url(tmp_path / "data" / "kitty_lab.sqlite3")


def test_sqlite_file_is_in_wal_mode_with_pragmas(db: Database, db_path: Path) -> None:
    with sqlite3.connect(db_path) as raw:  # an independent connection sees the persisted mode
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_runs_survive_a_new_database_instance(db: Database, db_path: Path) -> None:
    record = db.record_run("m", "p", MESSAGES, SETTINGS, [_kitty_result()])
    db.close()

    reopened = Database(_url(db_path)).init()
    detail = reopened.get_run(record.slug)
    assert detail is not None
    _assert_results_equal(detail.results[0], _kitty_result())
    _record_simple(reopened, "later")
    assert len(reopened.list_runs()) == 2


# --- schema versioning -------------------------------------------------------------


def test_init_stamps_head_and_is_idempotent(db: Database, db_path: Path) -> None:
    assert head_revision() == "0003"
    assert db.schema_revision() == head_revision()
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("SELECT version_num FROM alembic_version").fetchall() == [(head_revision(),)]

    record = _record_simple(db, "kept")
    db.init()
    Database(_url(db_path)).init()
    assert db.schema_revision() == head_revision()
    assert db.get_run(record.slug) is not None


def test_schema_before_init_is_empty_and_older_revision_is_upgraded(db_path: Path) -> None:
    db = Database(_url(db_path))
    with pytest.raises(StorageError, match="missing"):
        db.schema_revision()  # only init() may create the file
    db.init()
    with db.engine.begin() as conn:
        command.downgrade(alembic_config(conn), "base")
    assert db.schema_revision() is None
    assert "runs" not in inspect(db.engine).get_table_names()

    db.init()
    assert db.schema_revision() == head_revision()
    assert {"runs", "method_results", "page_stats"} <= set(inspect(db.engine).get_table_names())
    assert _record_simple(db, "after upgrade").status == "ok"


def test_database_from_a_newer_release_is_refused(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    with pytest.raises(StorageError, match="9999_future"):
        db.init()


def test_migrations_match_the_models(db: Database) -> None:
    # A model change without a new revision would show up here as a diff.
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


# --- StorageError ------------------------------------------------------------------


def test_folder_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="schema") as caught:
        Database(_url(blocker / "sub" / "kitty.sqlite3")).init()
    assert str(blocker) in str(caught.value)


def test_folder_removed_while_running(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    db = Database(_url(folder / "kitty.sqlite3")).init()
    _record_simple(db, "first")
    shutil.rmtree(folder)
    with pytest.raises(StorageError, match="missing") as caught:
        db.list_runs()
    assert caught.value.reason == "the database folder is missing" and caught.value.transient
    with pytest.raises(StorageError, match="missing"):
        _record_simple(db, "lost")  # only init() makes the folder: a removed volume may come back


def test_folder_restored_or_recreated_while_running(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    db = Database(_url(folder / "kitty.sqlite3")).init()
    first = _record_simple(db, "first")
    shutil.copytree(folder, tmp_path / "backup")
    shutil.rmtree(folder)
    shutil.copytree(tmp_path / "backup", folder)  # restored: a new file, the same runs
    second = _record_simple(db, "second")
    assert [run.slug for run in Database(_url(folder / "kitty.sqlite3")).list_runs()] == [second.slug, first.slug]

    shutil.rmtree(folder)
    folder.mkdir()  # the folder is back, empty: a write recreates the file
    third = _record_simple(db, "third")
    assert [run.slug for run in db.list_runs()] == [third.slug]


def test_locked_database(db: Database, db_path: Path) -> None:
    _record_simple(db, "before lock")
    impatient = Database(_url(db_path), busy_timeout_ms=100)
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        started = time.monotonic()
        with pytest.raises(StorageError, match="locked") as caught:
            _record_simple(impatient, "blocked")
        assert time.monotonic() - started < 5
        assert str(db_path) in str(caught.value)  # the details, for the server log...
        assert caught.value.reason == "the database is locked by another writer"  # ...and what visitors see
        assert caught.value.transient
        # WAL keeps the history readable while a writer holds the lock.
        assert [run.prompt for run in impatient.list_runs()] == ["prompt before lock"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _record_simple(impatient, "after lock")  # the same object recovers once the lock is gone
    assert len(impatient.list_runs()) == 2


def test_corrupt_file(db_path: Path) -> None:
    db_path.write_bytes(b"\x00garbage, not an SQLite header\xff" * 200)
    db = Database(_url(db_path))
    with pytest.raises(StorageError, match="not a database"):
        db.init()
    with pytest.raises(StorageError, match="not a database") as caught:
        db.list_runs()
    assert caught.value.reason == "the database file is damaged" and str(db_path) not in caught.value.reason


def test_password_is_masked_in_errors() -> None:
    with pytest.raises(StorageError) as caught:
        Database("nosuchdialect://kitty:s3cret@db.example/kitty")
    assert "s3cret" not in str(caught.value)
    assert "kitty:***@db.example" in str(caught.value)


def test_uninstalled_driver_is_a_storage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # make the driver import fail whatever is installed
    with pytest.raises(StorageError, match="psycopg2"):
        Database("postgresql+psycopg2://kitty:s3cret@localhost/kitty")
