"""Run lifecycle: a run is recorded when it starts and completed when it ends.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

`owner` and `heartbeat_at` tell a run still generating from one whose server died (it becomes "interrupted");
`finished_at` says when it ended. The status index serves the search for running runs. Runs stored before this
revision ended when they were written: they keep NULL here.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=160), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("finished_at", sa.DateTime(), nullable=True))
        batch.create_index("ix_runs_status", ["status"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_status")
        batch.drop_column("finished_at")
        batch.drop_column("heartbeat_at")
        batch.drop_column("owner")
