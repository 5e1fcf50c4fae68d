"""Where the database lives, how we connect to it, and how its schema is migrated.

Settings, first match wins:
  KITTY_DB_URL   full SQLAlchemy URL (any backend SQLAlchemy supports)
  KITTY_DB_PATH  SQLite file path
  default        data/kitty_lab.sqlite3 under the current working directory
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.pool import StaticPool

DEFAULT_DB_PATH = Path("data") / "kitty_lab.sqlite3"
DEFAULT_BUSY_TIMEOUT_MS = 5000
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

# Execution option that makes the SQLite `begin` hook take the write lock up front.
WRITE_LOCK_OPTION = "kitty_write_lock"

# SQLite's terse messages: what they usually mean for someone running the app (the log), and a short reason
# that is safe to show any visitor (no path, no URL).
_SQLITE_HINTS = {
    "database is locked": ("another connection kept it locked longer than the busy timeout",
                           "the database is locked by another writer"),
    "file is not a database": ("the file is corrupt or is not an SQLite database", "the database file is damaged"),
    "unable to open database file": ("its folder is missing or not accessible",
                                     "the database folder is missing or not accessible"),
    "no such table": ("the schema is missing; was the file deleted or replaced?", "the database has no tables"),
    "readonly database": ("the file or its folder is read-only", "the database is read-only"),
    "disk i/o error": ("the disk failed or the file went away", "the database disk failed"),
}
UNAVAILABLE = "the database is unavailable"


class StorageError(Exception):
    """Any failure to reach, read or write the database. `str()` is the full story for the server log (paths and
    the database URL, password hidden); `reason` is a short cause for visitors. `transient`: a retry may succeed
    (locked, missing, unreachable), as opposed to a write the database refuses (a constraint, bad data)."""

    def __init__(self, message: str, reason: str = UNAVAILABLE, transient: bool = True):
        super().__init__(message)
        self.reason = reason
        self.transient = transient


def resolve_url(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("KITTY_DB_URL"):
        return env["KITTY_DB_URL"]
    # Absolute now, so a later chdir cannot silently switch databases.
    path = Path(env.get("KITTY_DB_PATH") or DEFAULT_DB_PATH).absolute()
    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def mask_url(url: str) -> str:
    """The URL with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def sqlite_file(url: str) -> Path | None:
    """The file behind an SQLite URL; None for other backends, memory and file: URIs."""
    parsed = make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def describe(exc: BaseException) -> tuple[str, str]:
    """The driver's own message (not SQLAlchemy's wrapper with SQL and links) with a hint, and a short reason."""
    message = str(exc.orig) if isinstance(exc, DBAPIError) and exc.orig is not None else str(exc)
    for needle, (hint, reason) in _SQLITE_HINTS.items():
        if needle in message.lower():
            return f"{message} ({hint})", reason
    return message, UNAVAILABLE


def make_engine(url: str, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Engine:
    parsed = make_url(url)
    options: dict[str, Any] = {"pool_pre_ping": True, "json_serializer": json_text}
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, **options)
    if parsed.database in (None, "", ":memory:"):
        # A plain in-memory database lives and dies with its connection: share one.
        options.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    engine = create_engine(parsed, **options)
    _configure_sqlite(engine, busy_timeout_ms)
    return engine


def json_text(value: Any) -> str:
    """JSON columns hold standard JSON on every backend: NaN and infinities (which json.dumps would write as is,
    and PostgreSQL refuses) become null."""
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _configure_sqlite(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's begin hook below emit BEGIN: the sqlite3 module's legacy
        # mode would leave SELECTs and DDL outside transactions (see SQLAlchemy's
        # "Transactions with SQLite and the sqlite3 driver").
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            # busy_timeout first: switching to WAL itself may wait for a lock.
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            _enable_wal(cursor, busy_timeout_ms)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # A deferred transaction that later writes cannot wait for the lock if
        # another writer committed meanwhile (SQLITE_BUSY at once, busy_timeout
        # ignored); taking the write lock at BEGIN makes writers queue instead.
        immediate = conn.get_execution_options().get(WRITE_LOCK_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _enable_wal(cursor: Any, busy_timeout_ms: int) -> None:
    """WAL lets readers proceed while one writer commits (a no-op in memory).

    Switching a fresh file to WAL needs an exclusive lock, and SQLite answers
    "database is locked" at once, without its busy handler, while a sibling
    process does the same switch. Retry within the busy timeout instead."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def alembic_config(connection: Connection) -> Config:
    """An Alembic config without alembic.ini, migrating over `connection`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    assert head is not None, "storage/migrations/versions has no revision"
    return head


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to `revision` in one transaction holding the write lock,
    so processes starting together migrate one after the other, not in a race."""
    with engine.execution_options(**{WRITE_LOCK_OPTION: True}).begin() as connection:
        command.upgrade(alembic_config(connection), revision)
