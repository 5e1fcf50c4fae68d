"""Initial schema: runs, method_results, page_stats.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Written out in full (not imported from storage.models) so this revision keeps
describing the original schema after the models change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slug", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("slug", name="uq_runs_slug"),
    )
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
    op.create_index("ix_runs_model", "runs", ["model"])

    op.create_table(
        "method_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("output_text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("total_s", sa.Float(), nullable=True),
        sa.Column("kv_bytes", sa.BigInteger(), nullable=True),
        sa.Column("fp16_bytes", sa.BigInteger(), nullable=True),
        sa.Column("key_bits", sa.Float(), nullable=True),
        sa.Column("value_bits", sa.Float(), nullable=True),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("agreement", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_method_results_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_method_results"),
    )
    op.create_index("ix_method_results_run_id", "method_results", ["run_id"])
    op.create_index("ix_method_results_method", "method_results", ["method"])

    op.create_table(
        "page_stats",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("result_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("head", sa.Integer(), nullable=False),
        sa.Column("page", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("boost_mask", sa.LargeBinary(), nullable=False),
        sa.Column("magnitudes", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["result_id"],
            ["method_results.id"],
            name="fk_page_stats_result_id_method_results",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_page_stats"),
    )
    op.create_index("ix_page_stats_result_layer_head", "page_stats", ["result_id", "layer", "head"])


def downgrade() -> None:
    op.drop_table("page_stats")
    op.drop_table("method_results")
    op.drop_table("runs")
