"""ORM tables. Schema changes go through a new Alembic revision in migrations/versions."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Named constraints let later Alembic batch migrations on SQLite find and alter them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC (SQLite has no time zones) and hands back aware UTC datetimes.

    Naive input is taken to be UTC already.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.astimezone(timezone.utc).replace(tzinfo=None) if value.tzinfo else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunRow(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    slug: Mapped[str] = mapped_column(String(16), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    model: Mapped[str] = mapped_column(String(255), index=True)
    prompt: Mapped[str] = mapped_column(Text)
    messages: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    # Who is generating a running run (storage.liveness.this_process()) and when it last said so: a run whose
    # server died is told from one still generating (revision 0002).
    owner: Mapped[str | None] = mapped_column(String(160))
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    results: Mapped[list[MethodResultRow]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True, order_by="MethodResultRow.id"
    )


class MethodResultRow(Base):
    __tablename__ = "method_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    method: Mapped[str] = mapped_column(String(64), index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    output_text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(JSON)
    n_tokens: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    total_s: Mapped[float | None] = mapped_column(Float)
    kv_bytes: Mapped[int | None] = mapped_column(BigInteger)
    fp16_bytes: Mapped[int | None] = mapped_column(BigInteger)
    key_bits: Mapped[float | None] = mapped_column(Float)
    value_bits: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    agreement: Mapped[float | None] = mapped_column(Float)
    # FP16's answer fed through this method's cache (revision 0003)
    top1_agreement: Mapped[float | None] = mapped_column(Float)
    kl_from_fp16: Mapped[float | None] = mapped_column(Float)
    first_difference: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)

    run: Mapped[RunRow] = relationship(back_populates="results")
    page_stats: Mapped[list[PageStatRow]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="PageStatRow.id"
    )


class PageStatRow(Base):
    __tablename__ = "page_stats"
    __table_args__ = (Index("ix_page_stats_result_layer_head", "result_id", "layer", "head"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    result_id: Mapped[int] = mapped_column(ForeignKey("method_results.id", ondelete="CASCADE"))
    layer: Mapped[int] = mapped_column(Integer)
    head: Mapped[int] = mapped_column(Integer)
    page: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)  # mask length; packed bits are padded to bytes
    boost_mask: Mapped[bytes] = mapped_column(LargeBinary)  # codec.pack_mask
    magnitudes: Mapped[bytes] = mapped_column(LargeBinary)  # codec.pack_floats (float32 LE)


class VoteRow(Base):
    """A visitor's preference among a run's answers (revision 0003)."""

    __tablename__ = "votes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    choice: Mapped[str] = mapped_column(String(64))  # a method of the run, or "tie"
    blind: Mapped[bool] = mapped_column(Boolean)  # the methods were hidden behind letters
    shown: Mapped[list[str]] = mapped_column(JSON)  # the methods in the order shown (A, B, ...)
