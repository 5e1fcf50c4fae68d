"""Arena votes, and each answer's teacher-forced score against FP16.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

`votes`: which answer of a run a visitor preferred (a method, or "tie"), whether the methods were hidden behind
letters when they voted, and the order they were shown in. `method_results` gains the teacher-forced figures
(FP16's answer fed through the method's cache): top-1 agreement, mean KL from FP16 and the first position whose
top-1 token differs. They are columns, not metrics JSON, so the leaderboard averages them in SQL on any backend.
Runs stored before this revision have NULL there.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("method_results") as batch:
        batch.add_column(sa.Column("top1_agreement", sa.Float(), nullable=True))
        batch.add_column(sa.Column("kl_from_fp16", sa.Float(), nullable=True))
        batch.add_column(sa.Column("first_difference", sa.Integer(), nullable=True))
    op.create_table(
        "votes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("choice", sa.String(length=64), nullable=False),
        sa.Column("blind", sa.Boolean(), nullable=False),
        sa.Column("shown", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_votes_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_votes"),
    )
    op.create_index("ix_votes_run_id", "votes", ["run_id"])


def downgrade() -> None:
    op.drop_table("votes")
    with op.batch_alter_table("method_results") as batch:
        batch.drop_column("first_difference")
        batch.drop_column("kl_from_fp16")
        batch.drop_column("top1_agreement")
