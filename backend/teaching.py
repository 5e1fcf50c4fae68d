"""The teaching suite: why uniform 2-bit KV quantization collapses, and what protecting a few key channels buys.

Everything runs on the loaded model over fixed inputs, so a class sees the same numbers every time:
- teacher forcing over the bundled English text (the opening of Alice in Wonderland), one decode step per token
  through each method's cache: top-1 agreement with FP16, mean KL(FP16 || method) and the text's perplexity;
- pass-key retrieval: a 5-digit key hidden at a few depths of filler text, asked for at the end;
- the boost sweep (the paper's Figure 4): KL from FP16 as the boosted share of key channels goes from 0 to 1,
  channels chosen by magnitude or at random.
Methods run side by side in threads (one cache each). No Gradio here: progress goes to a callback.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from kernels.layout import key_page_bytes, value_page_bytes

from . import make_cache
from .analysis import bundled_text, mean_kl, passkey_prompt, perplexity, teacher_forced_logprobs
from .attention import use_kitty_attention
from .engine import InputError, encode_chat
from .methods import PRESETS, CacheConfig

# Sink + one key page + the value window + 1: only past this length does any value page (2-bit values) exist
MIN_TEXT_TOKENS = 32 + 128 + 128 + 1
DEFAULT_TEXT_TOKENS = 400
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)
SELECTIONS = ("magnitude", "random")
PREFIX = 16                          # tokens prefilled before teacher forcing starts
PASSKEY_NEW_TOKENS = 12
WORKERS = 3                          # methods computed at the same time

SUITE_COLUMNS = ["method", "top-1 agreement with FP16", "KL vs FP16 (nats/token)", "perplexity",
                 "pass-key found", "bits/element in full pages", "allocated KV vs FP16"]
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


def _forced_pass(model, input_ids: torch.Tensor, config: CacheConfig, tracker: _Tracker, prefix: int):
    """Teacher-forced log-probabilities of `input_ids` through a fresh cache, and that cache's final KV ratio."""
    cache = make_cache(model, config)
    last = [0]

    def tick(step: int, _steps: int) -> None:
        tracker.advance(step - last[0], f"teacher forcing: {config.name}")
        last[0] = step

    logprobs = teacher_forced_logprobs(model, input_ids, cache, prefix=prefix, progress=tick)
    stats = cache.stats()
    return logprobs, stats.kv_ratio


def forced_metrics(model, input_ids: torch.Tensor, methods: Mapping[str, CacheConfig], *, prefix: int = PREFIX,
                   progress: Progress | None = None, tracker: _Tracker | None = None,
                   workers: int = WORKERS) -> dict[str, dict]:
    """Per method: top-1 agreement with FP16, mean KL(FP16 || method), perplexity, KV bytes / FP16 bytes.
    The FP16 reference runs too when it is not among `methods`."""
    configs = {"fp16": PRESETS["fp16"], **methods}
    steps = input_ids.shape[1] - prefix - 1
    use_kitty_attention(model)                  # once, before the threads' make_cache calls
    tracker = tracker or _Tracker(progress, steps * len(configs))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teach") as pool:
        futures = {label: pool.submit(_forced_pass, model, input_ids, cfg, tracker, prefix)
                   for label, cfg in configs.items()}
        passes = {label: future.result() for label, future in futures.items()}
    reference = passes["fp16"][0]
    targets = input_ids[0, prefix:]
    results = {}
    for label in methods:
        logprobs, ratio = passes[label]
        results[label] = {
            "agreement": (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "kl": max(0.0, mean_kl(reference, logprobs)),     # exact zero for FP16, never -1e-9
            "perplexity": perplexity(logprobs, targets),
            "kv_ratio": ratio,
        }
    return results


def filler_for(tokenizer, tokens: int) -> int:
    """Filler sentences that make the pass-key prompt about `tokens` long."""
    base = encode_chat(tokenizer, passkey_prompt(tokenizer, 0.5, filler_sentences=0)[0]).shape[1]
    per = encode_chat(tokenizer, passkey_prompt(tokenizer, 0.5, filler_sentences=10)[0]).shape[1] - base
    return max(1, round((tokens - base) * 10 / max(per, 1)))


def passkey_results(model, tokenizer, methods: Mapping[str, CacheConfig], depths: Sequence[float] = DEFAULT_DEPTHS,
                    *, filler_sentences: int = 20, progress: Progress | None = None, tracker: _Tracker | None = None,
                    weight: int = 1, workers: int = WORKERS) -> dict[str, list[dict]]:
    """Per method, per depth: {depth, key, answer, found}; greedy decoding, a fresh cache per question.
    Each answered question advances `tracker` by `weight` units."""
    tracker = tracker or _Tracker(progress, len(methods) * len(depths) * weight)
    prompts = [passkey_prompt(tokenizer, depth, filler_sentences=filler_sentences, seed=i)
               for i, depth in enumerate(depths)]
    use_kitty_attention(model)

    def ask(label: str, config: CacheConfig) -> list[dict]:
        answers = []
        for depth, (messages, key) in zip(depths, prompts):
            ids = encode_chat(tokenizer, messages).to(model.device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     past_key_values=make_cache(model, config), max_new_tokens=PASSKEY_NEW_TOKENS,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            answers.append({"depth": depth, "key": key, "answer": answer, "found": key in answer})
            tracker.advance(weight, f"pass-key at depth {depth:.0%}: {label}")
        return answers

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="passkey") as pool:
        futures = {label: pool.submit(ask, label, config) for label, config in methods.items()}
        return {label: future.result() for label, future in futures.items()}


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
