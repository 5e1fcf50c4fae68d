"""What the studies share: the text, teacher-forced quality of any cache, caches with a policy per layer, ranks,
and the result record every study returns (JSON-ready: what the CLI writes and the Insights tab shows)."""
from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch
from transformers.cache_utils import Cache

from .. import make_cache, teaching
from ..analysis import bundled_text
from ..cache import CacheStats, KittyCache, KittyLayer
from ..engine import InputError
from ..methods import PRESETS, CacheConfig

Progress = Callable[[float, str], None]          # (fraction done in [0, 1], what is running)
PREFIX = teaching.PREFIX                         # tokens prefilled before teacher forcing starts
WORKERS = teaching.WORKERS                       # caches teacher-forced at the same time
# --quick: small pages so that a ~100-token text already has key pages, value pages and a static mask to study
QUICK_BASE = replace(PRESETS["kitty"], name="kitty (quick: sink 8, page 32, window 32)", sink=8, page_size=32,
                     local_window=32)


def sig(value: float, digits: int = 4) -> float:
    """Rounded to significant digits, not decimals: a KL of 3e-6 must not print as 0."""
    return float(f"{value:.{digits}g}")


def phase(progress: Progress | None, start: float, end: float) -> Progress | None:
    """The progress callback of one phase of a study that runs from `start` to `end` of the whole."""
    if progress is None:
        return None
    return lambda fraction, message: progress(start + (end - start) * fraction, message)


def min_tokens(config: CacheConfig) -> int:
    """Sink + one key page + the value window + 1: the shortest text on which every kind of page exists."""
    return config.sink + config.page_size + config.local_window + 1


def text_ids(tokenizer, tokens: int, config: CacheConfig) -> torch.Tensor:
    """(1, tokens) ids of the bundled text; InputError when it is too short for `config`'s pages or too long."""
    ids = tokenizer(bundled_text(), return_tensors="pt")["input_ids"]
    if not min_tokens(config) <= tokens <= ids.shape[1]:
        raise InputError(f"The text length must be between {min_tokens(config)} tokens (sink {config.sink} + a "
                         f"{config.page_size}-token page + the {config.local_window}-token value window, so that "
                         f"2-bit pages exist) and {ids.shape[1]} (the bundled text), not {tokens}.")
    return ids[:, :tokens]


def head_dim_of(model) -> int:
    text = model.config.get_text_config()
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def layered_cache(model, configs: Sequence[CacheConfig], layer_class: type[KittyLayer] = KittyLayer) -> KittyCache:
    """A KittyCache whose full-attention layer i follows configs[i], as a `layer_class`: one policy per layer."""
    cache = make_cache(model, configs[0])
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KittyLayer):
            cache.layers[i] = layer_class(configs[i], i)
    return cache


def forced_quality(model, input_ids: torch.Tensor, caches: Mapping[str, Callable[[], Cache]], *,
                   reference: torch.Tensor | None = None, progress: Progress | None = None,
                   workers: int = WORKERS) -> tuple[dict[str, dict], torch.Tensor]:
    """backend.teaching.forced_quality with each cache's bits per stored K/V element (16-bit buffers and metadata
    included) and KV ratio added to its kl, perplexity, agreement and stats."""
    results, reference = teaching.forced_quality(model, input_ids, caches, reference=reference, prefix=PREFIX,
                                                 progress=progress, workers=workers)
    for result in results.values():
        result.update(bits=element_bits(result["stats"]), kv_ratio=result["stats"].kv_ratio)
    return results, reference


def element_bits(stats: CacheStats) -> float:
    """Bits per stored key / value element (averaged), full-precision buffers and page metadata included."""
    return (stats.key_bits + stats.value_bits) / 2


def ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    _, inverse, counts = np.unique(np.asarray(values), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2)[inverse]


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equally long sequences (0 when either is constant)."""
    ra, rb = ranks(a) - (len(a) + 1) / 2, ranks(b) - (len(b) + 1) / 2
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator else 0.0


def top_overlap(truth, guess, k: int) -> float:
    """Share of the k largest entries of `truth` that are among the k largest of `guess`."""
    if k <= 0:
        return 1.0
    return len(set(np.argsort(-np.asarray(truth))[:k]) & set(np.argsort(-np.asarray(guess))[:k])) / k


def record(study: str, title: str, model, settings: Mapping, columns: list[str], rows: list[list],
           summarize: Callable[[dict], str], **data) -> dict:
    """A study's result: what ran (model, date, settings), a table (columns, rows), the study's own data for its
    figure, and a summary that summarize(result) writes from the record's numbers alone (so it can be checked)."""
    result = {"study": study, "title": title, "model": getattr(model, "kitty_model_name", type(model).__name__),
              "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
              "date": datetime.date.today().isoformat(), "settings": dict(settings), "columns": columns,
              "rows": rows, **data}
    result["summary"] = summarize(result)
    return result


def config_settings(config: CacheConfig) -> dict:
    """A config as the settings of a result (the fields a reader needs to rebuild it)."""
    return {k: v for k, v in config.as_dict().items() if k not in ("name", "seed")}
