"""The run log: comparisons in and out of storage.Database, for a page that keeps serving when the database does
not, and loses no answered run when the database comes back.

A run is written when it starts ("running") and again when it ends (its results, and how it ended), each time
whole under a slug chosen here, so a write can be retried and the permalink is known before the database
answers. One writer thread does every write. While the database is locked or gone it retries with backoff (the
engine reconnects, and recreates a deleted SQLite file once its folder is back) and the runs wait in memory, at
most MAX_PENDING_RUNS of them; a finished comparison waits up to SAVE_WAIT_S for its write and then says that the
run waits. The same thread beats the heart of this process's running runs and marks runs whose server died as
"interrupted", at start and every SWEEP_S. Database failures arrive as StorageError: the server log gets the
details, visitors the short reason."""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone

import numpy as np

from backend.engine import Comparison, GenerationSettings, MethodSnapshot, has_boost
from storage import (STATUS_CANCELLED, STATUS_STOPPED, Database, MethodResult, PageStat, RunDetail, RunEntry,
                     StorageError, new_slug)

log = logging.getLogger(__name__)

TIMELINE_POINTS = 200                # stored samples of the KV-bytes / speed curves per method
MAX_PENDING_RUNS = 100               # runs waiting in memory for the database...
MAX_PENDING_PAGE_STATS = 50_000      # ...and their page stats together (about 3 kB each in memory)
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 2.0   # backoff between attempts while the database is unavailable
SAVE_WAIT_S = 8.0                    # a finished comparison waits this long for its write (busy timeout: 5 s)
HEARTBEAT_S = 30.0                   # this process's running runs say they still run this often...
STALE_AFTER = timedelta(minutes=2)   # ...so one silent this long lost its server (on another host)
SWEEP_S = 60.0                       # how often to look for runs whose server died
# What a stored answer keeps of its scoring besides the score's columns: how it went, and the tokens to show
SCORE_METRICS = ("score_status", "score_note", "scored_tokens", "first_difference_tokens", "diverges_at",
                 "divergence_chars")


@dataclass(frozen=True)
class SaveOutcome:
    """Where a finished run went: into the database, into the queue that waits for it, or nowhere (queue full)."""

    slug: str
    saved: bool
    waiting: bool = False
    reason: str | None = None        # why it is not saved (yet): short, fit for any visitor

    @property
    def note(self) -> str:
        if self.saved:
            return f"Saved as run {self.slug}."
        if self.waiting:
            return (f"Not saved yet ({self.reason}): the run is kept and saved as {self.slug} as soon as the "
                    f"database is back.")
        return f"The run was not saved ({self.reason})."


class RunLog:
    def __init__(self, url: str | None = None):
        self.url = url
        self._db: Database | None = None
        self._db_lock = threading.Lock()
        self._changed = threading.Condition()         # guards what follows; notified whenever it changes
        self._pending: OrderedDict[str, RunEntry] = OrderedDict()   # slug -> the next state to write
        self._failed: dict[str, tuple[RunEntry, StorageError]] = {}  # slug -> its latest state that failed, why
        self._running: set[str] = set()               # this process's runs that have not finished
        self._retry_at, self._delay, self._closed = 0.0, 0.0, False
        self.problem: str | None = None               # why the last attempt failed; None once one succeeds
        self.startup_error: str | None = None
        try:
            self.database()
        except StorageError as exc:          # keep serving; the writer tries again
            self.startup_error = str(exc)
        self._writer = threading.Thread(target=self._write_loop, name="runlog-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close, 5.0)     # a server shutting down writes what waits, if it can

    def database(self) -> Database:
        """The database, opened and brought to the schema's head on first use (StorageError while it cannot be)."""
        with self._db_lock:
            if self._db is None:
                self._db = Database(self.url).init()
            return self._db

    def get(self, slug: str) -> RunDetail | None:
        return self.database().get_run(slug.strip())

    # -------------------------------------------------------------------- a run's life
    def begin(self, model: str, messages: Sequence[Mapping], settings: GenerationSettings,
              methods: Sequence[str]) -> RunEntry:
        """Record a comparison that starts now, as "running" (written in the background); finish() completes it."""
        prompt = str(messages[-1]["content"]) if messages else ""
        run = RunEntry(new_slug(), model, prompt, [dict(m) for m in messages],
                       {"generation": asdict(settings), "methods": list(methods)}, datetime.now(timezone.utc))
        with self._changed:
            self._running.add(run.slug)
            self._enqueue(run)           # with the queue full only the finished run is tried
            self._changed.notify_all()
        return run

    def finish(self, run: RunEntry, snapshots: Mapping[str, MethodSnapshot], memory_label: str, *,
               cancelled: bool = False, wait_s: float = SAVE_WAIT_S) -> SaveOutcome:
        """Complete `run` with every method's answer, metrics and (Kitty methods) page stats, in one transaction;
        its status says how it ended (stopped: Stop cut an answer or its scoring short). Waits up to `wait_s` for
        the write."""
        stopped = any("stopped" in (snap.status, snap.score_status) for snap in snapshots.values())
        entry = replace(run, status=STATUS_CANCELLED if cancelled else STATUS_STOPPED if stopped else None,
                        results=[method_result(snap, memory_label) for snap in snapshots.values()],
                        finished_at=datetime.now(timezone.utc))
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._running.discard(run.slug)
            if not self._enqueue(entry):
                log.error("run %s (%r) is lost: %d runs already wait for the database", run.slug, run.prompt[:80],
                          len(self._pending))
                reason = f"{self.problem or 'the database is slow to answer'}; {len(self._pending)} runs wait for it"
                return SaveOutcome(run.slug, False, reason=reason)
            self._retry_at = 0.0         # now, not at the end of a backoff
            self._changed.notify_all()
            while self._pending.get(run.slug) is entry and self._failed.get(run.slug, (None,))[0] is not entry:
                if not self._changed.wait(deadline - time.monotonic()):
                    break
            failed, why = self._failed.get(run.slug, (None, None))
            if self._pending.get(run.slug) is entry:
                reason = why.reason if failed is entry else self.problem or "the database is slow to answer"
                return SaveOutcome(run.slug, False, waiting=True, reason=reason)
            if failed is entry:              # refused for good (see _write)
                del self._failed[run.slug]
                return SaveOutcome(run.slug, False, reason=why.reason)
            return SaveOutcome(run.slug, True)

    def abandon(self, run: RunEntry, comparison: Comparison) -> None:
        """The client went away mid-run (tab closed, API client disconnected): stop the methods, as Stop does,
        complete the run as "cancelled" with what they wrote and free their caches. From a thread, since whatever
        closes a generator should not wait for a decode step."""
        def complete():
            comparison.stop()
            comparison.join()
            self.finish(run, comparison.snapshots(), comparison.memory_label, cancelled=True, wait_s=0)
            comparison.release()
        threading.Thread(target=complete, name=f"abandon-{run.slug}", daemon=True).start()

    def vote(self, slug: str, choice: str, *, blind: bool, shown: Sequence[str]):
        """Store a visitor's vote on a finished run (StorageError while the run is not in the database)."""
        return self.database().add_vote(slug, choice, blind=blind, shown=shown)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer after a last attempt at what waits (a server shutting down)."""
        with self._changed:
            self._closed, self._retry_at = True, 0.0
            self._changed.notify_all()
        self._writer.join(timeout)

    # -------------------------------------------------------------------- the writer
    def _enqueue(self, entry: RunEntry) -> bool:
        """Make `entry` its run's next write (an earlier state not written yet is dropped: this one has it all).
        False when other runs already fill the queue."""
        others = [e for slug, e in self._pending.items() if slug != entry.slug]
        if others and (len(others) >= MAX_PENDING_RUNS or
                       sum(map(_page_stat_count, others)) + _page_stat_count(entry) > MAX_PENDING_PAGE_STATS):
            return False
        self._pending[entry.slug] = entry
        return True

    def _write_loop(self) -> None:
        next_sweep = next_beat = time.monotonic()
        while True:
            with self._changed:
                while not self._closed:
                    now = time.monotonic()
                    due = min(next_sweep, next_beat, now if self._pending else float("inf"))
                    if max(due, self._retry_at) <= now:
                        break
                    self._changed.wait(max(due, self._retry_at) - now)
                work, running, closed = list(self._pending.items()), set(self._running), self._closed
            try:
                db = self.database()
                for slug, entry in work:
                    self._write(db, slug, entry)
                now = time.monotonic()
                if now >= next_beat:     # (rescheduled first: a failure waits for the next turn, not a retry)
                    next_beat = now + HEARTBEAT_S
                    db.touch_runs(running)
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    for slug in db.mark_interrupted(STALE_AFTER, keep=running):
                        log.warning("run %s was left running by a server that stopped: marked interrupted", slug)
                self._recovered()
            except StorageError as exc:
                self._attempt_failed(exc)
            except Exception as exc:         # a bug: log it and keep the writer, and every later run, alive
                log.exception("run log: the writer failed")
                self._attempt_failed(StorageError(str(exc)))
            if closed:
                return

    def _write(self, db: Database, slug: str, entry: RunEntry) -> None:
        try:
            db.save_run(entry)
        except Exception as exc:
            if isinstance(exc, StorageError) and exc.transient:
                raise
            # The database refuses this run itself (a constraint, bad data) or a bug does: retrying cannot help,
            # and it must not hold up the runs behind it
            log.error("run %s (%r) cannot be stored and is dropped", slug, entry.prompt[:80], exc_info=exc)
            refused = exc if isinstance(exc, StorageError) else StorageError(str(exc), "the run could not be stored")
            with self._changed:
                self._failed[slug] = (entry, refused)
                if self._pending.get(slug) is entry:
                    del self._pending[slug]
                self._changed.notify_all()
            return
        with self._changed:
            if self._pending.get(slug) is entry:
                del self._pending[slug]
            self._failed.pop(slug, None)
            self._changed.notify_all()

    def _recovered(self) -> None:
        with self._changed:
            if self.problem is not None:
                log.info("run log: the database answers again")
            self.problem, self._delay = None, 0.0

    def _attempt_failed(self, exc: StorageError) -> None:
        with self._changed:
            if self.problem is None:         # the details once per outage, not once per retry
                log.warning("run log: %s; %d run(s) wait and are retried", exc, len(self._pending))
            self.problem = exc.reason
            for slug, entry in self._pending.items():    # everything waiting is held up by it
                self._failed[slug] = (entry, exc)
            self._delay = min(max(2 * self._delay, RETRY_FIRST_S), RETRY_MAX_S)
            self._retry_at = time.monotonic() + self._delay
            self._changed.notify_all()


def _page_stat_count(entry: RunEntry) -> int:
    return sum(len(result.page_stats) for result in entry.results)


def _timeline(snap: MethodSnapshot) -> list[list]:
    points = snap.timeline
    if len(points) > TIMELINE_POINTS:
        keep = np.linspace(0, len(points) - 1, TIMELINE_POINTS).round().astype(int)
        points = [points[i] for i in keep]
    return [[round(p.elapsed_s, 4), p.tokens, p.kv_bytes, None if p.tokens_per_s is None else round(p.tokens_per_s, 3)]
            for p in points]


def method_result(snap: MethodSnapshot, memory_label: str) -> MethodResult:
    """A finished method as storage keeps it; page stats (all layers and KV heads of sequence 0) for methods with
    boosted channels."""
    score, scored = snap.score, snap.score_status == "scored"
    stats = []
    if has_boost(snap.config):
        for layer, (masks, magnitudes) in enumerate(zip(snap.boost_masks, snap.page_magnitudes)):
            if masks is None:
                continue
            for page in range(masks.shape[0]):
                for head in range(masks.shape[1]):
                    stats.append(PageStat(layer, head, page, masks[page, head].tolist(),
                                          magnitudes[page, head].float().tolist()))
    return MethodResult(
        method=snap.label, config=snap.config.as_dict(), output_text=snap.text, token_ids=list(snap.token_ids),
        n_tokens=snap.n_tokens, tokens_per_s=snap.tokens_per_s, ttft_s=snap.ttft_s, total_s=snap.elapsed_s,
        kv_bytes=snap.kv_bytes, fp16_bytes=snap.fp16_bytes, key_bits=snap.key_bits, value_bits=snap.value_bits,
        peak_memory_bytes=snap.peak_memory_bytes, agreement=snap.agreement, error=snap.error, page_stats=stats,
        # FP16, the reference, has no score of its own: it would only add zeros to the leaderboard's means
        top1_agreement=score.top1_agreement if scored else None, kl_from_fp16=score.kl if scored else None,
        first_difference=score.first_difference if scored else None,
        metrics={"status": snap.status, "prompt_tokens": snap.prompt_tokens, "key_pages": snap.key_pages,
                 "value_pages": snap.value_pages, "memory_label": memory_label, "timeline": _timeline(snap),
                 **{key: value for key, value in snap.metrics().items() if key in SCORE_METRICS}})


def stored_boost(result: MethodResult) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer: boost masks and page magnitudes as (pages, H, D) arrays, rebuilt from stored page stats."""
    by_layer: dict[int, list[PageStat]] = {}
    for stat in result.page_stats:
        by_layer.setdefault(stat.layer, []).append(stat)
    layers = {}
    for layer, stats in by_layer.items():
        pages = 1 + max(s.page for s in stats)
        heads = 1 + max(s.head for s in stats)
        dim = len(stats[0].boost_mask)
        masks = np.zeros((pages, heads, dim), dtype=bool)
        magnitudes = np.zeros((pages, heads, dim), dtype=np.float32)
        for s in stats:
            masks[s.page, s.head] = s.boost_mask
            magnitudes[s.page, s.head] = s.magnitudes
        layers[layer] = (masks, magnitudes)
    return layers


__all__ = ["RunLog", "SaveOutcome", "StorageError", "method_result", "stored_boost"]
