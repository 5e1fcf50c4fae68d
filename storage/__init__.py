"""Kitty Lab run history: SQLAlchemy storage with Alembic-versioned schema.

    from storage import Database, StorageError
    db = Database().init()          # KITTY_DB_URL / KITTY_DB_PATH / data/kitty_lab.sqlite3
    rec = db.record_run(model, prompt, messages, settings, results)
    db.get_run(rec.slug)

A run can also be written when it starts and again when it ends (db.save_run(RunEntry(...)), same slug): a
server that dies in between leaves it "running" until db.mark_interrupted() finds it.

Visitors' votes on a run's answers (db.add_vote) and each answer's teacher-forced score add up in
db.leaderboard().
"""

from .db import StorageError, resolve_url
from .records import (
    STATUS_CANCELLED,
    STATUS_INTERRUPTED,
    STATUS_RUNNING,
    STATUS_STOPPED,
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
from .repository import CSV_COLUMNS, Database, new_slug

__all__ = [
    "CSV_COLUMNS",
    "Database",
    "LeaderboardRow",
    "MethodResult",
    "PageStat",
    "RunDetail",
    "RunEntry",
    "RunRecord",
    "RunSummary",
    "STATUS_CANCELLED",
    "STATUS_INTERRUPTED",
    "STATUS_RUNNING",
    "STATUS_STOPPED",
    "StorageError",
    "VOTE_TIE",
    "Vote",
    "new_slug",
    "resolve_url",
]
