"""The run log: comparisons in and out of storage.Database, for a page that keeps serving when the database
does not. Every database failure arrives as StorageError, which the handlers turn into a warning; a database
that failed at start-up (locked, folder missing) is tried again on the next use."""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict

import numpy as np

from backend.engine import GenerationSettings, MethodSnapshot, has_boost
from storage import Database, MethodResult, PageStat, RunDetail, RunRecord, StorageError

TIMELINE_POINTS = 200        # stored samples of the KV-bytes / speed curves per method


class RunLog:
    def __init__(self, url: str | None = None):
        self.url = url
        self._db: Database | None = None
        self._lock = threading.Lock()
        self.startup_error: str | None = None
        try:
            self.database()
        except StorageError as exc:          # keep serving; the warning shows on the page and the next use retries
            self.startup_error = str(exc)

    def database(self) -> Database:
        with self._lock:
            if self._db is None:
                self._db = Database(self.url).init()
            return self._db

    def save(self, model: str, messages: Sequence[Mapping], settings: GenerationSettings,
             snapshots: Mapping[str, MethodSnapshot], memory_label: str) -> RunRecord:
        """One transaction for the whole comparison: every method's answer, metrics and (Kitty methods) page stats."""
        prompt = str(messages[-1]["content"]) if messages else ""
        results = [method_result(snap, memory_label) for snap in snapshots.values()]
        return self.database().record_run(model, prompt, messages,
                                          {"generation": asdict(settings), "methods": list(snapshots)}, results)

    def get(self, slug: str) -> RunDetail | None:
        return self.database().get_run(slug.strip())


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
        metrics={"status": snap.status, "prompt_tokens": snap.prompt_tokens, "key_pages": snap.key_pages,
                 "value_pages": snap.value_pages, "memory_label": memory_label, "timeline": _timeline(snap)})


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


__all__ = ["RunLog", "StorageError", "method_result", "stored_boost"]
