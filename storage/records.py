"""Plain dataclasses that cross the storage boundary.

Callers hand `MethodResult`/`PageStat` in (or plain dicts with the same keys)
and get frozen dataclasses back; no ORM object or session ever leaves the package.
The same `MethodResult`/`PageStat` types are used for input and output so a
stored result compares equal to what was recorded (floats in `magnitudes` are
stored as float32, so compare those approximately).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# Metric columns of `method_results`, in CSV order. All nullable.
METRIC_FIELDS: tuple[str, ...] = (
    "tokens_per_s",
    "ttft_s",
    "total_s",
    "kv_bytes",
    "fp16_bytes",
    "key_bits",
    "value_bits",
    "peak_memory_bytes",
    "agreement",
    "top1_agreement",
    "kl_from_fp16",
    "first_difference",
)
# A vote for no single answer
VOTE_TIE = "tie"

# Run status: derived from its results' errors once it ended normally...
STATUS_OK = "ok"
STATUS_PARTIAL = "partial"
STATUS_FAILED = "failed"
# ...or saying how it ended otherwise.
STATUS_RUNNING = "running"          # recorded when it started, not finished (yet)
STATUS_STOPPED = "stopped"          # a user stopped it: the answers are cut short
STATUS_CANCELLED = "cancelled"      # its client went away (tab closed, API client disconnected) before the end
STATUS_INTERRUPTED = "interrupted"  # its server ended (crash, kill) before the run did


@dataclass(frozen=True)
class PageStat:
    """Which channels of one KV page (layer, head, page) got boosted precision."""

    layer: int
    head: int
    page: int
    boost_mask: list[bool]  # one flag per channel, length head_dim
    magnitudes: list[float]  # per-channel mean |k| that chose the mask (float32)


@dataclass(frozen=True)
class MethodResult:
    """What one cache method produced for a run; `error` is set when it failed."""

    method: str
    config: dict[str, Any] = field(default_factory=dict)
    output_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    n_tokens: int = 0
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    kv_bytes: int | None = None
    fp16_bytes: int | None = None
    key_bits: float | None = None
    value_bits: float | None = None
    peak_memory_bytes: int | None = None
    agreement: float | None = None  # free-running: share of tokens identical to the fp16 output
    top1_agreement: float | None = None  # teacher-forced: share of FP16's tokens the method would also pick first
    kl_from_fp16: float | None = None  # teacher-forced: mean KL(FP16 || method), nats per token
    first_difference: int | None = None  # teacher-forced: first position whose top-1 token differs from FP16's
    metrics: dict[str, Any] = field(default_factory=dict)  # anything without a column
    error: str | None = None
    page_stats: list[PageStat] = field(default_factory=list)

    @classmethod
    def coerce(cls, value: MethodResult | Mapping[str, Any]) -> MethodResult:
        """Accept a MethodResult or a dict with the same keys (unknown keys raise TypeError)."""
        if isinstance(value, MethodResult):
            return value
        data = dict(value)
        stats = [s if isinstance(s, PageStat) else PageStat(**s) for s in data.pop("page_stats", None) or []]
        return cls(**data, page_stats=stats)


@dataclass(frozen=True)
class RunEntry:
    """A run's whole state, as `Database.save_run` writes it under its slug: the same entry written twice stores
    it once, so a write can be retried, and a later state (the results) replaces an earlier one (started).

    `status` None: derived from the results' errors (ok, partial, failed)."""

    slug: str
    model: str
    prompt: str
    messages: list[dict[str, Any]]
    settings: dict[str, Any]
    created_at: datetime  # timezone-aware (naive is taken as UTC)
    status: str | None = STATUS_RUNNING
    results: list[MethodResult] = field(default_factory=list)
    finished_at: datetime | None = None


@dataclass(frozen=True)
class RunRecord:
    """Returned by `record_run`: enough to build the permalink."""

    id: int
    slug: str
    created_at: datetime  # timezone-aware, UTC
    status: str


@dataclass(frozen=True)
class RunSummary:
    """One line of the history table."""

    id: int
    slug: str
    created_at: datetime  # timezone-aware, UTC
    model: str
    prompt: str  # truncated to SUMMARY_PROMPT_CHARS
    status: str
    methods: list[str]  # in the order they were recorded
    method_status: list[str] = field(default_factory=list)  # how each one ended (done, stopped, error, ...)


@dataclass(frozen=True)
class RunDetail:
    """A whole run as reopened from its permalink."""

    id: int
    slug: str
    created_at: datetime  # timezone-aware, UTC
    model: str
    prompt: str
    messages: list[dict[str, Any]]
    settings: dict[str, Any]
    status: str
    results: list[MethodResult]


@dataclass(frozen=True)
class Vote:
    """A stored vote."""

    id: int
    run_slug: str
    created_at: datetime  # timezone-aware, UTC
    choice: str  # a method of the run, or VOTE_TIE
    blind: bool
    shown: list[str]


@dataclass(frozen=True)
class LeaderboardRow:
    """One method's votes and measured quality over the stored runs."""

    method: str
    votes: int  # votes cast on runs that include this method
    wins: int  # ...for this method's answer
    ties: int  # ...for no single answer
    scored: int  # answers scored against FP16 by teacher forcing
    top1_agreement: float | None  # their mean
    kl_from_fp16: float | None  # their mean

    @property
    def win_rate(self) -> float | None:
        return self.wins / self.votes if self.votes else None
