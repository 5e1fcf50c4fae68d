"""`Database`: the storage API. Every call runs in its own short-lived session
and returns plain dataclasses from storage.records; every database failure
surfaces as StorageError.

A run is written whole under its slug (`save_run`): when it starts, as
"running", and again when it ends, with its results. A run whose server died
meanwhile is found by `mark_interrupted`."""

from __future__ import annotations

import csv
import json
import secrets
import string
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from os import PathLike
from pathlib import Path
from typing import IO, Any

from alembic.util import CommandError
from sqlalchemy import ColumnElement, Engine, Select, delete, func, insert, select, update
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from .codec import pack_floats, pack_mask, unpack_floats, unpack_mask
from .liveness import is_gone, this_process
from .db import (
    DEFAULT_BUSY_TIMEOUT_MS,
    WRITE_LOCK_OPTION,
    StorageError,
    current_revision,
    describe,
    make_engine,
    mask_url,
    migrate,
    resolve_url,
    sqlite_file,
)
from .models import MethodResultRow, PageStatRow, RunRow, VoteRow
from .records import (
    METRIC_FIELDS,
    STATUS_FAILED,
    STATUS_INTERRUPTED,
    STATUS_OK,
    STATUS_PARTIAL,
    STATUS_RUNNING,
    VOTE_TIE,
    LeaderboardRow,
    MethodResult,
    PageStat,
    RunDetail,
    RunEntry,
    RunRecord,
    RunSummary,
    Vote,
)

SUMMARY_PROMPT_CHARS = 200
SLUG_LENGTH = 10
# Letters and digits only, so slugs survive copy-paste and URL autolinking.
# 62**10 ≈ 8e17: a collision is negligible, and would only fail that one
# record_run with a StorageError (unique constraint), never overwrite a run.
_SLUG_ALPHABET = string.ascii_letters + string.digits
# A numeric run id as text: ASCII digits ("²".isdigit() is true too), short enough for a 64-bit id.
_MAX_ID_DIGITS = 18
# Spreadsheets run a text cell that starts with one of these as a formula (CSV injection): such cells are
# exported with a leading apostrophe, which spreadsheets take as "text" and do not show.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
# Failures a later attempt may get past: a lock, a missing file, a lost connection.
_TRANSIENT = (OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError, OSError)

CSV_COLUMNS: tuple[str, ...] = (
    "run_id",
    "slug",
    "created_at",
    "model",
    "status",
    "prompt",
    "settings",
    "method",
    "config",
    "n_tokens",
    *METRIC_FIELDS,
    "metrics",
    "error",
    "output_text",
)


class Database:
    """One database, from an explicit SQLAlchemy URL or (url=None) the KITTY_DB_* settings.

    Call `init()` once at start-up to create or upgrade the schema.
    """

    def __init__(self, url: str | None = None, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> None:
        self.url = resolve_url() if url is None else url
        self.masked_url = mask_url(self.url)
        self.owner = this_process()  # the name running runs written here carry
        self._file: Path | None = None
        self._file_lock = threading.Lock()
        self._file_identity: tuple[int, int] | None = None  # of the SQLite file the pool's connections opened
        self._migrated = False  # that file is at head (init(), or a write recreated it)
        with self._guard("Could not open the database", need_file=False):
            self._file = sqlite_file(self.url)
            self._engine = make_engine(self.url, busy_timeout_ms)
        self._reads = sessionmaker(self._engine, expire_on_commit=False)
        self._writes = sessionmaker(
            self._engine.execution_options(**{WRITE_LOCK_OPTION: True}), expire_on_commit=False
        )

    def __repr__(self) -> str:
        return f"Database({self.masked_url!r})"

    @property
    def engine(self) -> Engine:
        """For migrations tooling and tests; application code should not need it."""
        return self._engine

    def init(self) -> Database:
        """Create the SQLite folder if needed and migrate the schema to head. Idempotent."""
        with self._guard("Could not create or upgrade the schema", need_file=False), self._file_lock:
            if self._file is not None:
                self._file.parent.mkdir(parents=True, exist_ok=True)
            migrate(self._engine)
            self._migrated = True
            if self._file is not None:
                self._file_identity = _file_identity(self._file)
        return self

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (None before init)."""
        with self._guard("Could not read the schema version"), self._engine.connect() as connection:
            return current_revision(connection)

    def close(self) -> None:
        """Close pooled connections (a later call simply reconnects)."""
        self._engine.dispose()

    # --- writes -----------------------------------------------------------

    def record_run(
        self,
        model: str,
        prompt: str,
        messages: Sequence[Mapping[str, Any]],
        settings: Mapping[str, Any],
        results: Iterable[MethodResult | Mapping[str, Any]],
        *,
        created_at: datetime | None = None,
    ) -> RunRecord:
        """Store a finished run with all its method results and page stats in one transaction.

        `results` items are MethodResult or dicts with its fields (page_stats as
        PageStat or dicts). A failed method carries `error`; the run's status is
        "ok", "partial" or "failed" from those errors. `created_at` defaults to
        now (naive values are taken as UTC). If anything fails, nothing is written.
        """
        created = created_at or datetime.now(timezone.utc)
        entry = RunEntry(new_slug(), model, prompt, list(messages), dict(settings), created, status=None,
                         results=list(results), finished_at=created)
        return self.save_run(entry)

    def save_run(self, entry: RunEntry) -> RunRecord:
        """Write a run's whole state under its slug, in one transaction: a new run, or the same run again with its
        status and results replaced. Writing the same entry twice leaves one run, so a failed write can simply be
        retried. A run that got further than "running" is never put back to it. If anything fails, nothing is
        written; once its SQLite file is gone, a write recreates it as soon as its folder is there."""
        items = [MethodResult.coerce(result) for result in entry.results]
        status = entry.status or _run_status(items)
        with self._guard("Could not record the run", write=True), self._writes.begin() as session:
            run = session.scalars(select(RunRow).where(RunRow.slug == entry.slug)).one_or_none()
            if run is None:
                run = RunRow(slug=entry.slug, created_at=entry.created_at, owner=self.owner)
                session.add(run)
            elif status == STATUS_RUNNING:
                return _record(run)
            else:  # its earlier results go (their page stats with them: ON DELETE CASCADE)
                session.execute(delete(MethodResultRow).where(MethodResultRow.run_id == run.id))
            run.model, run.prompt, run.status = entry.model, entry.prompt, status
            run.messages = [dict(message) for message in entry.messages]
            run.settings = dict(entry.settings)
            run.heartbeat_at, run.finished_at = datetime.now(timezone.utc), entry.finished_at
            run.results = [_result_row(item) for item in items]
            session.flush()  # assigns the result ids the page stat rows point to
            stat_rows = [
                _page_stat_row(row.id, stat) for row, item in zip(run.results, items) for stat in item.page_stats
            ]
            if stat_rows:
                # Bulk insert: a run can carry tens of thousands of page stats.
                session.execute(insert(PageStatRow), stat_rows)
            return _record(run)

    def touch_runs(self, slugs: Iterable[str]) -> None:
        """The heartbeat of runs this process is still generating (see mark_interrupted)."""
        slugs = list(slugs)
        if not slugs:
            return
        with self._guard("Could not update running runs", write=True), self._writes.begin() as session:
            session.execute(
                update(RunRow)
                .where(RunRow.slug.in_(slugs), RunRow.status == STATUS_RUNNING)
                .values(heartbeat_at=datetime.now(timezone.utc))
            )

    def mark_interrupted(self, stale_after: timedelta, keep: Iterable[str] = ()) -> list[str]:
        """Runs left "running" by a server that died become "interrupted": their owner was a process of this host
        that no longer runs (a restart sees its own crash at once), or their heartbeat is older than
        `stale_after` (a server elsewhere). `keep`: runs this process is generating. Returns the slugs marked."""
        now, keep = datetime.now(timezone.utc), set(keep)
        with self._guard("Could not look for interrupted runs"), self._reads.begin() as session:
            running = session.execute(
                select(RunRow.id, RunRow.slug, RunRow.owner, RunRow.heartbeat_at).where(RunRow.status == STATUS_RUNNING)
            ).all()
        dead = [
            run
            for run in running
            if run.slug not in keep
            and (is_gone(run.owner) or run.heartbeat_at is None or run.heartbeat_at < now - stale_after)
        ]
        if dead:
            with self._guard("Could not mark interrupted runs", write=True), self._writes.begin() as session:
                session.execute(
                    update(RunRow)
                    .where(RunRow.id.in_([run.id for run in dead]), RunRow.status == STATUS_RUNNING)
                    .values(status=STATUS_INTERRUPTED, finished_at=now)
                )
        return [run.slug for run in dead]

    # --- reads ------------------------------------------------------------

    def list_runs(
        self,
        method: str | None = None,
        model: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[RunSummary]:
        """Runs newest first. `method`: runs that include that method;
        `since`/`until`: inclusive bounds on created_at (naive = UTC)."""
        stmt = _runs_query(method, model, since, until, limit, offset)
        with self._guard("Could not list runs"), self._reads.begin() as session:
            runs = session.scalars(stmt).all()
            methods: dict[int, list[str]] = defaultdict(list)
            states: dict[int, list[str]] = defaultdict(list)
            method_rows = session.execute(
                select(
                    MethodResultRow.run_id,
                    MethodResultRow.method,
                    MethodResultRow.error,
                    MethodResultRow.metrics["status"].as_string(),
                )
                .where(MethodResultRow.run_id.in_([run.id for run in runs]))
                .order_by(MethodResultRow.id)
            )
            for run_id, name, error, state in method_rows:
                methods[run_id].append(name)
                states[run_id].append(state or ("error" if error else "done"))
            return [
                RunSummary(
                    id=run.id,
                    slug=run.slug,
                    created_at=run.created_at,
                    model=run.model,
                    prompt=_truncate(run.prompt, SUMMARY_PROMPT_CHARS),
                    status=run.status,
                    methods=methods[run.id],
                    method_status=states[run.id],
                )
                for run in runs
            ]

    def get_run(self, slug_or_id: str | int, *, with_page_stats: bool = True) -> RunDetail | None:
        """A run by permalink slug or numeric id (also as a digit string), or None.

        with_page_stats=False skips the (possibly large) page stats: results then
        have empty `page_stats`."""
        loader = selectinload(RunRow.results)
        if with_page_stats:
            loader = loader.selectinload(MethodResultRow.page_stats)
        with self._guard("Could not load the run"), self._reads.begin() as session:
            run = _find_run(session, slug_or_id, loader)
            if run is None:
                return None
            return RunDetail(
                id=run.id,
                slug=run.slug,
                created_at=run.created_at,
                model=run.model,
                prompt=run.prompt,
                messages=run.messages,
                settings=run.settings,
                status=run.status,
                results=[_result_out(row, with_page_stats) for row in run.results],
            )

    def distinct_models(self) -> list[str]:
        with self._guard("Could not list models"), self._reads.begin() as session:
            return list(session.scalars(select(RunRow.model).distinct().order_by(RunRow.model)))

    def distinct_methods(self) -> list[str]:
        with self._guard("Could not list methods"), self._reads.begin() as session:
            return list(session.scalars(select(MethodResultRow.method).distinct().order_by(MethodResultRow.method)))

    def add_vote(self, slug: str, choice: str, *, blind: bool, shown: Sequence[str]) -> Vote:
        """Store a visitor's preference among the answers of run `slug`: one of its methods, or VOTE_TIE.
        StorageError when the run is not stored (yet) or the choice names none of its methods."""
        with self._guard("Could not store the vote", write=True), self._writes.begin() as session:
            run = session.scalars(select(RunRow).where(RunRow.slug == slug)).one_or_none()
            if run is None:
                raise StorageError(f"no run {slug!r} to vote on", "the run is not saved yet")
            methods = set(session.scalars(select(MethodResultRow.method).where(MethodResultRow.run_id == run.id)))
            if choice != VOTE_TIE and choice not in methods:
                raise StorageError(
                    f"vote for {choice!r}, not a method of run {slug}", "the vote names no answer of this run", False
                )
            row = VoteRow(
                run_id=run.id, created_at=datetime.now(timezone.utc), choice=choice, blind=blind, shown=list(shown)
            )
            session.add(row)
            session.flush()
            return Vote(row.id, slug, _as_utc(row.created_at), choice, blind, list(shown))

    def votes(self, slug: str) -> list[Vote]:
        """The votes on one run, oldest first."""
        with self._guard("Could not read the votes"), self._reads.begin() as session:
            rows = session.execute(
                select(VoteRow, RunRow.slug).join(RunRow, RunRow.id == VoteRow.run_id).where(RunRow.slug == slug)
                .order_by(VoteRow.id)
            ).all()
            return [Vote(v.id, run_slug, _as_utc(v.created_at), v.choice, v.blind, v.shown) for v, run_slug in rows]

    def leaderboard(self, model: str | None = None) -> list[LeaderboardRow]:
        """Per method: the votes cast on runs that include it and how many chose it, and the mean teacher-forced
        score of its answers (FP16 itself, the reference, has none); methods with neither are left out."""
        runs = select(RunRow.id).where(RunRow.model == model) if model is not None else select(RunRow.id)
        with self._guard("Could not read the leaderboard"), self._reads.begin() as session:
            seen = dict(
                session.execute(
                    select(MethodResultRow.method, func.count(func.distinct(VoteRow.id)))
                    .join(VoteRow, VoteRow.run_id == MethodResultRow.run_id)
                    .where(MethodResultRow.run_id.in_(runs.scalar_subquery()))
                    .group_by(MethodResultRow.method)
                ).all()
            )
            chosen = dict(
                session.execute(
                    select(VoteRow.choice, func.count(VoteRow.id))
                    .where(VoteRow.run_id.in_(runs.scalar_subquery()))
                    .group_by(VoteRow.choice)
                ).all()
            )
            ties = dict(
                session.execute(
                    select(MethodResultRow.method, func.count(func.distinct(VoteRow.id)))
                    .join(VoteRow, VoteRow.run_id == MethodResultRow.run_id)
                    .where(VoteRow.choice == VOTE_TIE, MethodResultRow.run_id.in_(runs.scalar_subquery()))
                    .group_by(MethodResultRow.method)
                ).all()
            )
            quality = {
                method: (count, top1, kl)
                for method, count, top1, kl in session.execute(
                    select(
                        MethodResultRow.method,
                        func.count(MethodResultRow.kl_from_fp16),
                        func.avg(MethodResultRow.top1_agreement),
                        func.avg(MethodResultRow.kl_from_fp16),
                    )
                    .where(
                        MethodResultRow.kl_from_fp16.is_not(None), MethodResultRow.run_id.in_(runs.scalar_subquery())
                    )
                    .group_by(MethodResultRow.method)
                ).all()
            }
        rows = []
        for method in sorted(set(seen) | set(quality)):
            count, top1, kl = quality.get(method, (0, None, None))
            rows.append(
                LeaderboardRow(method, seen.get(method, 0), chosen.get(method, 0), ties.get(method, 0), count,
                               None if top1 is None else float(top1), None if kl is None else float(kl))
            )
        return rows

    def export_csv(
        self,
        path_or_file: str | PathLike[str] | IO[str],
        method: str | None = None,
        model: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> int:
        """Write one CSV row per method result (columns: CSV_COLUMNS) and return the row count.

        Filters select runs as in list_runs (no limit by default); `method` also
        keeps only that method's rows. JSON fields are JSON strings, None is empty,
        created_at is ISO 8601 UTC. Token ids and the chat history are left out.
        Text that a spreadsheet would run as a formula (=, +, -, @, tab, CR first)
        starts with an apostrophe.
        """
        run_ids = _runs_query(method, model, since, until, limit, offset).with_only_columns(RunRow.id)
        stmt = (
            select(RunRow, MethodResultRow)
            .join(MethodResultRow, MethodResultRow.run_id == RunRow.id)
            .where(RunRow.id.in_(run_ids.scalar_subquery()))
            .order_by(RunRow.created_at.desc(), RunRow.id.desc(), MethodResultRow.id)
        )
        if method is not None:
            stmt = stmt.where(MethodResultRow.method == method)
        with (
            self._guard("Could not export runs to CSV"),
            _open_for_writing(path_or_file) as out,
            self._reads.begin() as session,
        ):
            writer = csv.writer(out)
            writer.writerow(CSV_COLUMNS)
            count = 0
            for run, result in session.execute(stmt):
                writer.writerow([_cell(value) for value in _csv_row(run, result)])
                count += 1
            return count

    # --- helpers ----------------------------------------------------------

    @contextmanager
    def _guard(self, action: str, *, need_file: bool = True, write: bool = False) -> Iterator[None]:
        """Turn any database (or file system) failure into StorageError."""
        try:
            if need_file and self._file is not None:
                self._check_file(action, recreate=write)
            yield
        # ImportError: the URL names a database driver that is not installed.
        except (SQLAlchemyError, CommandError, OSError, ImportError) as exc:
            message, reason = describe(exc)
            raise StorageError(
                f"{action}: {message} (database: {self.masked_url})", reason, isinstance(exc, _TRANSIENT)
            ) from exc

    def _check_file(self, action: str, *, recreate: bool) -> None:
        """Pooled connections keep using a deleted file's inode, where writes would vanish unseen: notice a
        missing or replaced file and drop them. A write recreates a missing file (and brings a replaced one to
        head) once its folder is there; only init() creates the folder, since a folder that disappears may be a
        volume that comes back."""
        assert self._file is not None
        with self._file_lock:
            identity = _file_identity(self._file)
            if identity != self._file_identity:
                self._engine.dispose()
                self._file_identity, self._migrated = identity, False
            if identity is None and not (recreate and self._file.parent.is_dir()):
                what = "file" if self._file.parent.is_dir() else "folder"
                raise StorageError(
                    f"{action}: the database {what} of {self._file} is missing (database: {self.masked_url})",
                    f"the database {what} is missing",
                )
            if recreate and not self._migrated:
                migrate(self._engine)
                self._file_identity, self._migrated = _file_identity(self._file), True


def new_slug() -> str:
    return "".join(secrets.choice(_SLUG_ALPHABET) for _ in range(SLUG_LENGTH))


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:  # gone, or its folder is
        return None
    return stat.st_dev, stat.st_ino


def _record(run: RunRow) -> RunRecord:
    return RunRecord(id=run.id, slug=run.slug, created_at=_as_utc(run.created_at), status=run.status)


def _run_status(items: Sequence[MethodResult]) -> str:
    failed = sum(item.error is not None for item in items)
    if failed == 0:
        return STATUS_OK
    return STATUS_FAILED if failed == len(items) else STATUS_PARTIAL


def _result_row(item: MethodResult) -> MethodResultRow:
    return MethodResultRow(
        method=item.method,
        config=dict(item.config),
        output_text=item.output_text,
        token_ids=[int(token) for token in item.token_ids],
        n_tokens=item.n_tokens,
        metrics=dict(item.metrics),
        error=item.error,
        **{name: getattr(item, name) for name in METRIC_FIELDS},
    )


def _page_stat_row(result_id: int, stat: PageStat) -> dict[str, Any]:
    return {
        "result_id": result_id,
        "layer": stat.layer,
        "head": stat.head,
        "page": stat.page,
        "head_dim": len(stat.boost_mask),
        "boost_mask": pack_mask(stat.boost_mask),
        "magnitudes": pack_floats(stat.magnitudes),
    }


def _result_out(row: MethodResultRow, with_page_stats: bool) -> MethodResult:
    stats = [
        PageStat(
            layer=stat.layer,
            head=stat.head,
            page=stat.page,
            boost_mask=unpack_mask(stat.boost_mask, stat.head_dim),
            magnitudes=unpack_floats(stat.magnitudes),
        )
        for stat in (row.page_stats if with_page_stats else [])
    ]
    return MethodResult(
        method=row.method,
        config=row.config,
        output_text=row.output_text,
        token_ids=row.token_ids,
        n_tokens=row.n_tokens,
        metrics=row.metrics,
        error=row.error,
        page_stats=stats,
        **{name: getattr(row, name) for name in METRIC_FIELDS},
    )


def _runs_query(
    method: str | None,
    model: str | None,
    since: datetime | None,
    until: datetime | None,
    limit: int | None,
    offset: int,
) -> Select[tuple[RunRow]]:
    conditions: list[ColumnElement[bool]] = []
    if method is not None:
        conditions.append(RunRow.results.any(MethodResultRow.method == method))
    if model is not None:
        conditions.append(RunRow.model == model)
    if since is not None:
        conditions.append(RunRow.created_at >= since)
    if until is not None:
        conditions.append(RunRow.created_at <= until)
    return (
        select(RunRow)
        .where(*conditions)
        .order_by(RunRow.created_at.desc(), RunRow.id.desc())
        .limit(limit)
        .offset(offset)
    )


def _find_run(session: Session, key: str | int, loader: Any) -> RunRow | None:
    query = select(RunRow).options(loader)
    if isinstance(key, int):
        fits = 0 <= key < 10**_MAX_ID_DIGITS
        return session.scalars(query.where(RunRow.id == key)).one_or_none() if fits else None
    run = session.scalars(query.where(RunRow.slug == key)).one_or_none()
    if run is None and key.isascii() and key.isdigit() and len(key) <= _MAX_ID_DIGITS:
        run = session.scalars(query.where(RunRow.id == int(key))).one_or_none()
    return run


def _csv_row(run: RunRow, result: MethodResultRow) -> list[Any]:
    return [
        run.id,
        run.slug,
        run.created_at.isoformat(),
        run.model,
        run.status,
        run.prompt,
        json.dumps(run.settings, sort_keys=True),
        result.method,
        json.dumps(result.config, sort_keys=True),
        result.n_tokens,
        *(getattr(result, name) for name in METRIC_FIELDS),
        json.dumps(result.metrics, sort_keys=True),
        result.error,
        result.output_text,
    ]


def _cell(value: Any) -> Any:
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_START) else value


def _open_for_writing(path_or_file: str | PathLike[str] | IO[str]) -> AbstractContextManager[IO[str]]:
    """Open a path for the csv module; a file object is used as is and left open."""
    if isinstance(path_or_file, (str, PathLike)):
        return open(path_or_file, "w", newline="", encoding="utf-8")
    return nullcontext(path_or_file)


def _as_utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
