"""Kitty Lab run history: SQLAlchemy storage with Alembic-versioned schema.

    from storage import Database, StorageError
    db = Database().init()          # KITTY_DB_URL / KITTY_DB_PATH / data/kitty_lab.sqlite3
    rec = db.record_run(model, prompt, messages, settings, results)
    db.get_run(rec.slug)
"""

from .db import StorageError, resolve_url
from .records import MethodResult, PageStat, RunDetail, RunRecord, RunSummary
from .repository import CSV_COLUMNS, Database

__all__ = [
    "CSV_COLUMNS",
    "Database",
    "MethodResult",
    "PageStat",
    "RunDetail",
    "RunRecord",
    "RunSummary",
    "StorageError",
    "resolve_url",
]
