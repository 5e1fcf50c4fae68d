"""Alembic migrations for the Kitty Lab database, run by `Database.init()`.

There is no alembic.ini: `storage.db.alembic_config(connection)` builds the
config in code. To add a revision after changing storage/models.py, run against
a database at head (e.g. a scratch SQLite file)::

    from alembic import command
    from storage import Database
    from storage.db import alembic_config

    db = Database("sqlite:////tmp/scratch.sqlite3").init()
    with db.engine.begin() as conn:
        command.revision(alembic_config(conn), message="what changed", autogenerate=True)

then review the generated file in versions/ (SQLite ALTERs are emitted as batch operations).
"""
