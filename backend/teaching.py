"""The teaching suite: why uniform 2-bit KV quantization collapses, and what protecting a few key channels buys.

Everything runs on the loaded model over fixed inputs, so a class sees the same numbers every time:
- teacher forcing over the bundled English text (the opening of Alice in Wonderland) through each method's
  cache, each token seeing the cache it would see when decoded (analysis.teacher_forced_logprobs): top-1 agreement with FP16, mean KL(FP16 || method) and the text's perplexity;
- pass-key retrieval: a 5-digit key hidden at a few depths of filler text, asked for at the end;
- the boost sweep (the paper's Figure 4): KL from FP16 as the boosted share of key channels goes from 0 to 1,
  channels chosen by magnitude, at random, or query-aware (beyond the paper: BENCHMARKS.md section 6).
Methods run side by side in threads (one cache each). No Gradio here: progress goes to a callback.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import torch
from transformers.cache_utils import Cache

from kernels.dequantize import dequantize_keys_ref
from kernels.layout import key_page_bytes, value_page_bytes
from kernels.quantize import quantize_keys_ref

from . import make_cache
from .analysis import (DATA, bundled_text, mean_kl, passkey_ids, passkey_prompt, perplexity, story_sentences,
                       teacher_forced_logprobs)
from .attention import use_kitty_attention
from .engine import InputError
from .methods import PRESETS, CacheConfig
from .model import share_cpu

# Sink + one key page + the value window + 1: only past this length does any value page (2-bit values) exist
MIN_TEXT_TOKENS = 32 + 128 + 128 + 1
DEFAULT_TEXT_TOKENS = 400
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)
SELECTIONS = ("magnitude", "random", "query")   # the boost sweep's curves: the paper's, its control, ours
PREFIX = 16                          # tokens prefilled before teacher forcing starts
PASSKEY_NEW_TOKENS = 8                # the answer starts "The secret number is": the digits, a full stop
WORKERS = 3                          # methods computed at the same time

SUITE_COLUMNS = ["method", "top-1 agreement with FP16", "KL vs FP16 (nats/token)", "perplexity",
                 "pass-key found", "bits/element in full pages", "KV used vs FP16"]
SWEEP_COLUMNS = ["selection", "boost fraction", "KL vs FP16 (nats/token)", "top-1 agreement with FP16",
                 "perplexity"]

Progress = Callable[[float, str], None]      # (fraction done in [0, 1], what is running)


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list]

    def records(self) -> list[dict]:
        return [dict(zip(self.columns, row)) for row in self.rows]


class _Tracker:
    """Adds up the progress of work units running in several threads into one fraction for the callback."""

    def __init__(self, callback: Progress | None, total: int):
        self.callback, self.total, self.done = callback, max(total, 1), 0
        self.lock = threading.Lock()

    def advance(self, units: int, message: str) -> None:
        with self.lock:
            self.done += units
            fraction = min(1.0, self.done / self.total)
        if self.callback:
            self.callback(fraction, message)


def _sig(value: float, digits: int = 4) -> float:
    """Rounded to significant digits, not decimals: a KL of 3e-6 must not print as 0."""
    return float(f"{value:.{digits}g}")


def page_bits(config: CacheConfig, head_dim: int) -> float:
    """Bits per key/value element (averaged) in a full page, metadata included: what a long text's cache tends
    to. Measured bytes of a short text are dominated by full-precision buffers instead."""
    g = config.page_size
    keys = 16.0 if config.k_bits == 16 else 8 * key_page_bytes(1, head_dim, g, config.boosted_channels(head_dim))
    values = 16.0 if config.v_bits == 16 else 8 * value_page_bytes(1, head_dim, g, config.v_bits)
    per_element = head_dim * g
    return ((keys if config.k_bits == 16 else keys / per_element) +
            (values if config.v_bits == 16 else values / per_element)) / 2


def text_ids(tokenizer, tokens: int) -> torch.Tensor:
    """(1, tokens) ids of the bundled text; InputError outside [MIN_TEXT_TOKENS, the text's length]."""
    ids = tokenizer(bundled_text(), return_tensors="pt")["input_ids"]
    if not MIN_TEXT_TOKENS <= tokens <= ids.shape[1]:
        raise InputError(f"The text length must be between {MIN_TEXT_TOKENS} tokens (so that 2-bit value pages "
                         f"exist: sink 32 + key page 128 + value window 128) and {ids.shape[1]} (the bundled "
                         f"text), not {tokens}.")
    return ids[:, :tokens]


def forced_quality(model, input_ids: torch.Tensor, caches: Mapping[str, Callable[[], Cache]], *,
                   reference: torch.Tensor | None = None, prefix: int = PREFIX, progress: Progress | None = None,
                   tracker: _Tracker | None = None, workers: int = WORKERS) -> tuple[dict[str, dict], torch.Tensor]:
    """Teacher-force `input_ids` through a fresh cache from each factory (`workers` at a time, a thread each) and
    compare every step's next-token distribution with the FP16 preset's (`reference`: its log-probabilities,
    teacher-forced here when None). Returns (per label: top-1 agreement with FP16, mean KL(FP16 || cache),
    perplexity, and the cache's final stats; the reference)."""
    runs = dict(caches) if reference is not None else {"fp16": partial(make_cache, model, PRESETS["fp16"]), **caches}
    steps = input_ids.shape[1] - prefix - 1
    tracker = tracker or _Tracker(progress, steps * len(runs))
    use_kitty_attention(model)                  # once, before the threads' make_cache calls

    def run(label: str, factory: Callable[[], Cache]):
        share_cpu(workers)
        cache, last = factory(), [0]

        def tick(step: int, _steps: int) -> None:
            tracker.advance(step - last[0], f"teacher forcing: {label}")
            last[0] = step

        return teacher_forced_logprobs(model, input_ids, cache, prefix=prefix, progress=tick), cache.stats()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teach") as pool:
        futures = {label: pool.submit(run, label, factory) for label, factory in runs.items()}
        passes = {label: future.result() for label, future in futures.items()}
    if reference is None:
        reference = passes["fp16"][0]
    targets = input_ids[0, prefix:]
    results = {label: {"agreement": (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                       "kl": max(0.0, mean_kl(reference, logprobs)),     # exact zero for FP16, never -1e-9
                       "perplexity": perplexity(logprobs, targets), "stats": stats}
               for label, (logprobs, stats) in passes.items()}
    return results, reference


def forced_metrics(model, input_ids: torch.Tensor, methods: Mapping[str, CacheConfig], *, prefix: int = PREFIX,
                   progress: Progress | None = None, tracker: _Tracker | None = None,
                   workers: int = WORKERS) -> dict[str, dict]:
    """Per method: top-1 agreement with FP16, mean KL(FP16 || method), perplexity, KV bytes / FP16 bytes."""
    quality, _ = forced_quality(model, input_ids, {label: partial(make_cache, model, config)
                                                   for label, config in methods.items()},
                                prefix=prefix, progress=progress, tracker=tracker, workers=workers)
    return {label: {**{k: v for k, v in quality[label].items() if k != "stats"},
                    "kv_ratio": quality[label]["stats"].kv_ratio} for label in methods}


def filler_for(tokenizer, tokens: int) -> int:
    """Story sentences that make the pass-key prompt about `tokens` long (the first count that reaches it)."""
    base = passkey_ids(tokenizer, passkey_prompt(tokenizer, 0.5, filler_sentences=0)[0]).shape[1]
    story = story_sentences()
    lengths = [len(tokenizer(" " + s)["input_ids"]) for s in story]
    count, total = 0, base
    while total < tokens:
        total += lengths[count % len(story)]
        count += 1
    return max(1, count)


def key_found(key: str, answer: str) -> bool:
    """The answer names the key: one of its numbers is the key itself ("604949" is not "60494")."""
    return key in re.findall(r"\d+", answer)


def _ask(model, tokenizer, methods: Mapping[str, CacheConfig], questions: Sequence[dict], tracker: _Tracker,
         weight: int, workers: int) -> dict[str, list[dict]]:
    """Per method, each question ({ids, key, depth, ...}) answered greedily through a fresh cache: the question's
    fields but the ids, plus prompt_tokens, answer and found. `workers` methods at a time, a thread each; each
    answer advances `tracker` by `weight`."""
    use_kitty_attention(model)

    def answers(label: str, config: CacheConfig) -> list[dict]:
        share_cpu(workers)
        rows = []
        for question in questions:
            ids = question["ids"].to(model.device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     past_key_values=make_cache(model, config), max_new_tokens=PASSKEY_NEW_TOKENS,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            rows.append({"method": label, **{k: v for k, v in question.items() if k != "ids"},
                         "prompt_tokens": ids.shape[1], "answer": answer, "found": key_found(question["key"], answer)})
            tracker.advance(weight, f"pass-key, {ids.shape[1]} tokens, depth {question['depth']:.0%}: {label}")
        return rows

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="passkey") as pool:
        futures = {label: pool.submit(answers, label, config) for label, config in methods.items()}
        return {label: future.result() for label, future in futures.items()}


def _question(tokenizer, depth: float, filler_sentences: int, seed: int, **fields) -> dict:
    messages, key = passkey_prompt(tokenizer, depth, filler_sentences=filler_sentences, seed=seed)
    return {"ids": passkey_ids(tokenizer, messages), "key": key, "depth": depth, "seed": seed, **fields}


def passkey_results(model, tokenizer, methods: Mapping[str, CacheConfig], depths: Sequence[float] = DEFAULT_DEPTHS,
                    *, filler_sentences: int = 20, progress: Progress | None = None, tracker: _Tracker | None = None,
                    weight: int = 1, workers: int = WORKERS) -> dict[str, list[dict]]:
    """Per method, per depth (a key each): {depth, key, answer, found, ...}; greedy decoding, a fresh cache per
    question. Each answered question advances `tracker` by `weight` units."""
    tracker = tracker or _Tracker(progress, len(methods) * len(depths) * weight)
    questions = [_question(tokenizer, depth, filler_sentences, seed=i) for i, depth in enumerate(depths)]
    return _ask(model, tokenizer, methods, questions, tracker, weight, workers)


def passkey_grid(model, tokenizer, methods: Mapping[str, CacheConfig], lengths: Sequence[int],
                 depths: Sequence[float], seeds: Sequence[int], *, progress: Progress | None = None,
                 workers: int = WORKERS) -> dict:
    """Pass-key retrieval at several prompt lengths, depths and keys: {"found": {method: [hits per length]},
    "questions": len(depths) * len(seeds) per length, "answers": [...]}. A fresh cache per question, greedy."""
    tracker = _Tracker(progress, len(methods) * len(lengths) * len(depths) * len(seeds))
    questions = [_question(tokenizer, depth, filler_for(tokenizer, length), seed, length=length)
                 for length in lengths for depth in depths for seed in seeds]
    answers = _ask(model, tokenizer, methods, questions, tracker, 1, workers)
    found = {label: [sum(a["found"] for a in rows if a["length"] == length) for length in lengths]
             for label, rows in answers.items()}
    return {"lengths": list(lengths), "depths": list(depths), "seeds": list(seeds), "found": found,
            "questions": len(depths) * len(seeds), "answers": [a for rows in answers.values() for a in rows]}


def run_suite(model, tokenizer, methods: Mapping[str, CacheConfig], *, text_tokens: int = DEFAULT_TEXT_TOKENS,
              depths: Sequence[float] = DEFAULT_DEPTHS, progress: Progress | None = None) -> Table:
    """The whole suite, one row per method (FP16 first): agreement, KL, perplexity, pass-key hits, KV ratio.
    The pass-key prompts are about as long as the text, so they reach the quantized pages too."""
    if not methods:
        raise InputError("Choose at least one method for the suite.")
    ids = text_ids(tokenizer, text_tokens)
    methods = {"fp16": PRESETS["fp16"], **methods}
    forced_units = (ids.shape[1] - PREFIX - 1) * len(methods)
    # A pass-key question costs about as much as 2 * PASSKEY_NEW_TOKENS teacher-forced steps (a prefill and
    # PASSKEY_NEW_TOKENS decode steps)
    question = 2 * PASSKEY_NEW_TOKENS
    tracker = _Tracker(progress, forced_units + len(methods) * len(depths) * question)
    forced = forced_metrics(model, ids, methods, tracker=tracker)
    keys = passkey_results(model, tokenizer, methods, depths, filler_sentences=filler_for(tokenizer, text_tokens),
                           tracker=tracker, weight=question)
    text_config = model.config.get_text_config()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    rows = []
    for label, config in methods.items():
        m, hits = forced[label], sum(a["found"] for a in keys[label])
        rows.append([label, _sig(m["agreement"]), _sig(m["kl"]), _sig(m["perplexity"]), f"{hits}/{len(depths)}",
                     _sig(page_bits(config, head_dim), 3), _sig(m["kv_ratio"])])
    return Table(SUITE_COLUMNS, rows)


def boost_sweep(model, input_ids: torch.Tensor, *, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                selections: Sequence[str] = SELECTIONS, base: CacheConfig = PRESETS["kivi-k2v2*"],
                progress: Progress | None = None) -> Table:
    """KL from FP16 as the boosted share of key channels sweeps `fractions`, per channel selection (Figure 4).
    At 0 and 1 every selection boosts the same channels (none / all), so those runs are shared."""
    configs: dict[str, CacheConfig] = {}
    for fraction in fractions:
        for selection in selections:
            shared = fraction in (0.0, 1.0)
            key = f"{fraction:g}" if shared else f"{fraction:g}/{selection}"
            configs.setdefault(key, replace(base, name=f"boost {fraction:g} ({'all' if shared else selection})",
                                            alpha=float(fraction), selection=selection))
    metrics = forced_metrics(model, input_ids, configs, progress=progress)
    rows = []
    for selection in selections:
        for fraction in fractions:
            m = metrics[f"{fraction:g}" if fraction in (0.0, 1.0) else f"{fraction:g}/{selection}"]
            rows.append([selection, fraction, _sig(m["kl"]), _sig(m["agreement"]), _sig(m["perplexity"])])
    return Table(SWEEP_COLUMNS, rows)


# ---------------------------------------------------------------------------------------------- precomputed
PRECOMPUTED = DATA / "teaching_precomputed.json"
PRECOMPUTED_COMMAND = "python -m backend.teaching --out backend/data/teaching_precomputed.json"
SUITE_METHODS = ("kivi-k4v4", "kivi-k2v2", "kivi-k2v2*", "kitty", "kitty-pro")
PASSKEY_METHODS = ("fp16", "kivi-k2v2", "kivi-k2v2*", "kitty", "kitty-pro")


def page_anatomy(model, tokenizer, page_size: int = 128, sink: int = 32) -> dict:
    """One real key page, for the explanation: the first page after the sink of the bundled text, in the layer
    and KV head whose loudest channel stands out most. Mean |k| per channel, the channels Kitty boosts there
    (top 12.5 % by that mean), and the loudest and quietest channel before and after 2-bit and 4-bit min/max
    quantization, through the cache's own quantize / dequantize references."""
    from transformers import DynamicCache
    ids = tokenizer(bundled_text(), return_tensors="pt")["input_ids"][:, :sink + page_size].to(model.device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    pages = torch.stack([layer.keys[0, :, sink:sink + page_size].float().cpu() for layer in cache.layers])
    magnitudes = pages.abs().mean(2)                                                # (layers, H, D)
    outlier = magnitudes.amax(-1) / magnitudes.median(-1).values
    layer, head = divmod(int(outlier.argmax()), magnitudes.shape[1])
    page, mags = pages[layer, head], magnitudes[layer, head]                        # (G, D), (D,)
    d = page.shape[1]
    boosted = mags.topk(-(-d // 8)).indices.sort().values
    x = page[None, None]                                                           # (1, 1, G, D)

    def round_trip(ch: torch.Tensor) -> torch.Tensor:                             # ch: the channels at 4 bits
        low, high, scale, zero = quantize_keys_ref(x, ch, ch.shape[-1])
        return dequantize_keys_ref(low, high, ch, scale, zero, torch.float32)[0, 0]
    two_bit = round_trip(torch.empty((1, 1, 0), dtype=torch.uint8))
    four_bit = round_trip(torch.arange(d, dtype=torch.uint8)[None, None])

    def channel(c: int) -> dict:
        return {"channel": c, "values": page[:, c].tolist(), "two_bit": two_bit[:, c].tolist(),
                "four_bit": four_bit[:, c].tolist(), "mean_abs": float(mags[c]),
                "error_two_bit": float((two_bit[:, c] - page[:, c]).abs().mean()),
                "error_four_bit": float((four_bit[:, c] - page[:, c]).abs().mean())}
    return {"layer": layer, "head": head, "tokens": [sink, sink + page_size], "magnitudes": mags.tolist(),
            "boosted": boosted.tolist(), "loud": channel(int(mags.argmax())), "quiet": channel(int(mags.argmin()))}


def precompute(model, tokenizer, *, text_tokens: int | None = None, lengths: Sequence[int] = (1024, 2048, 4096),
               depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9), seeds: Sequence[int] = (0,),
               suite_methods: Sequence[str] = SUITE_METHODS, passkey_methods: Sequence[str] = PASSKEY_METHODS,
               progress: Progress | None = None) -> dict:
    """What the Teaching tab shows at once: the suite over the whole bundled text, pass-key retrieval at several
    thousand tokens, and the anatomy of one real page, with the settings that made them."""
    import platform
    from datetime import datetime, timezone

    import transformers
    say = progress or (lambda fraction, message: None)
    tokens = text_tokens or tokenizer(bundled_text(), return_tensors="pt")["input_ids"].shape[1]
    started = datetime.now(timezone.utc)
    say(0.0, "page anatomy")
    anatomy = page_anatomy(model, tokenizer)
    suite = run_suite(model, tokenizer, {m: PRESETS[m] for m in suite_methods}, text_tokens=tokens,
                      progress=lambda f, m: say(0.4 * f, m))
    grid = passkey_grid(model, tokenizer, {m: PRESETS[m] for m in passkey_methods}, lengths, depths, seeds,
                        progress=lambda f, m: say(0.4 + 0.6 * f, m))
    return {"schema": 1, "model": model.kitty_model_name, "command": PRECOMPUTED_COMMAND,
            "date": started.isoformat(timespec="seconds"),
            "seconds": round((datetime.now(timezone.utc) - started).total_seconds()),
            "machine": {"device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
                        "cpu": platform.machine(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
            "suite": {"text_tokens": tokens, "columns": suite.columns, "rows": suite.rows},
            "passkey": grid, "anatomy": anatomy}


def load_precomputed(path=PRECOMPUTED) -> dict | None:
    """The shipped precomputed results, or None when the file is missing or unreadable."""
    import json
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    import argparse
    import json
    import sys
    from pathlib import Path

    from .model import load_model
    parser = argparse.ArgumentParser(prog="python -m backend.teaching",
                                     description="Precompute the Teaching tab's results on the default model.")
    parser.add_argument("--out", type=Path, default=PRECOMPUTED)
    parser.add_argument("--quick", action="store_true", help="short texts and prompts (a check, not results)")
    parser.add_argument("--lengths", type=int, nargs="*", help="pass-key prompt lengths in tokens")
    args = parser.parse_args(argv)
    model, tokenizer = load_model()
    settings = dict(text_tokens=MIN_TEXT_TOKENS, lengths=(MIN_TEXT_TOKENS + 64,), depths=(0.5,), seeds=(0,),
                    suite_methods=("kivi-k2v2", "kitty"), passkey_methods=("fp16", "kivi-k2v2")) if args.quick else {}
    if args.lengths:
        settings["lengths"] = tuple(args.lengths)
    result = precompute(model, tokenizer, progress=lambda f, m: print(f"{f:6.1%} {m}", file=sys.stderr, flush=True),
                        **settings)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
