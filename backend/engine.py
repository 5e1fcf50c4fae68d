"""The comparison engine: one conversation, several KV cache methods, generated at the same time.

Each method runs `model.generate` in its own thread with its own cache. A streamer in that thread sees every
new token between two decode steps, when the cache is consistent, so it reads the cache's live stats there
(KV bytes, bits, boost masks) and publishes an immutable `MethodSnapshot`. `Comparison.updates()` merges the
methods' progress into a stream of states that a UI redraws as often as it likes; `Comparison.run()` just
waits for the end. No Gradio here: the web app, the JSON API and the tests drive the same object.

    comparison = prepare_comparison(model, tokenizer, [{"role": "user", "content": "Hi"}],
                                    resolve_methods(["fp16", "kitty"]), GenerationSettings(max_new_tokens=32))
    for state in comparison.updates():
        print({label: snap.text for label, snap in state.items()})
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace

import psutil
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.streamers import BaseStreamer

from kernels.decode_attention import gather_kv

from . import make_cache, memory
from .analysis import mean_kl, teacher_forced_logprobs
from .attention import use_kitty_attention
from .cache import KittyLayer
from .methods import METHODS, CacheConfig, method_config
from .model import share_cpu

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS_CAP = 1024
REFERENCE = "fp16"                  # the method every other answer is compared with
CUSTOM = "custom"
MAX_METHODS = len(METHODS) + 1      # every preset and the custom method
MAX_SEED = 2**32 - 1                # what every random generator (numpy's too) takes; also bounds top-k
CAPTURE_EVERY = 16                  # tokens between two live snapshots of the focused layer's key magnitudes
SPEED_WINDOW = 8                    # tokens in the rolling tokens/s of the timeline


class InputError(ValueError):
    """A request the user can fix (empty prompt, too long, bad setting); its message is shown as is."""


@dataclass(frozen=True)
class Limits:
    """The operator's bounds on one comparison. prepare_comparison checks them, and the model's context (prompt
    plus new tokens; the custom method's sink and window), before anything is tokenized or allocated."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS_CAP
    max_chars: int = 100_000        # characters of the whole conversation, earlier turns included
    max_messages: int = 200         # messages in the conversation, earlier turns included


# ---------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class GenerationSettings:
    """How every method generates: the same settings (and seed) for all, so only the cache differs."""

    max_new_tokens: int = 64
    sample: bool = False            # False: greedy; True: temperature / top-p / top-k sampling
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 50                 # 0 turns top-k off
    seed: int = 0

    @classmethod
    def from_dict(cls, data: Mapping) -> GenerationSettings:
        """Settings from JSON-like data (the API); unknown keys and wrong types are an InputError."""
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise InputError(f"unknown generation setting(s): {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        values = {}
        for name, value in data.items():
            kind = {"int": int, "float": float, "bool": bool}[known[name]]
            if kind is bool and not isinstance(value, bool):
                raise InputError(f"{name} must be true or false, not {value!r}")
            if kind is not bool and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or not math.isfinite(value)):
                raise InputError(f"{name} must be a number, not {value!r}")
            if kind is int and value != int(value):
                raise InputError(f"{name} must be a whole number, not {value!r}")
            values[name] = kind(value)
        return cls(**values)

    def validate(self, max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP) -> GenerationSettings:
        """Every field, sampling ones included while greedy (they are stored with the run): finite and in range."""
        if not 1 <= self.max_new_tokens <= max_new_tokens_cap:
            raise InputError(f"Max new tokens must be between 1 and {max_new_tokens_cap} on this server "
                             f"(got {self.max_new_tokens}).")
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise InputError(f"Temperature and top-p must be numbers (got {self.temperature}, {self.top_p}).")
        if self.sample:
            if not 0 < self.temperature <= 5:
                raise InputError(f"Temperature must be above 0 and at most 5 (got {self.temperature}).")
            if not 0 < self.top_p <= 1:
                raise InputError(f"Top-p must be above 0 and at most 1 (got {self.top_p}).")
        if not 0 <= self.top_k <= MAX_SEED:
            raise InputError(f"Top-k must be 0 (off) to {MAX_SEED} (got {self.top_k}).")
        if not 0 <= self.seed <= MAX_SEED:
            raise InputError(f"The seed must be a whole number from 0 to {MAX_SEED} (got {self.seed}).")
        return self


def resolve_methods(names: Sequence[str], custom: Mapping | None = None) -> dict[str, CacheConfig]:
    """Method label -> CacheConfig, in the order of METHODS; "custom" takes its settings from `custom`. The
    custom sink and window are checked against a model's context by prepare_comparison."""
    if isinstance(names, str) or not isinstance(names, Sequence | None) or \
            not all(isinstance(name, str) for name in names or []):
        raise InputError("Methods must be a list of method names, e.g. [\"fp16\", \"kitty\"].")
    if len(names or []) > MAX_METHODS:
        raise InputError(f"Choose at most {MAX_METHODS} methods per comparison (got {len(names)}).")
    names = list(dict.fromkeys(names or []))
    if not names:
        raise InputError("Choose at least one method to compare.")
    unknown = [n for n in names if n not in METHODS and n != CUSTOM]
    if unknown:
        raise InputError(f"Unknown method(s) {', '.join(map(repr, unknown))}: choose from "
                         f"{', '.join(METHODS)} or '{CUSTOM}'.")
    methods = {name: method_config(name) for name in METHODS if name in names}
    if CUSTOM in names:
        if not isinstance(custom, Mapping | None):
            raise InputError("Custom method: its settings must be an object, e.g. {\"k_bits\": 2, \"sink\": 32}.")
        seed = (custom or {}).get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InputError(f"Custom method: seed={seed!r} must be a whole number from 0 to {MAX_SEED}")
        try:
            methods[CUSTOM] = method_config(CUSTOM, **dict(custom or {}))
        except (ValueError, TypeError) as exc:
            raise InputError(f"Custom method: {exc}") from exc
    return methods


def describe_config(config: CacheConfig) -> str:
    """A one-line summary of a method's settings, e.g. 'K2 V2 · sink 32 · page 128 · window 128 · 12.5% boosted'."""
    if config.is_full_precision:
        return "16-bit keys and values (no quantization)"
    parts = [f"K{config.k_bits} V{config.v_bits}", f"sink {config.sink}", f"page {config.page_size}",
             f"window {config.local_window}"]
    if has_boost(config):
        parts.append(f"{config.alpha:.1%} boosted" + (" at random" if config.selection == "random" else ""))
    return " · ".join(parts)


def has_boost(config: CacheConfig) -> bool:
    """A Kitty-style method: some key channels of each page are boosted from 2 to 4 bits."""
    return config.k_bits == 2 and config.alpha > 0


def model_context(model, tokenizer) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None)
    return int(context or tokenizer.model_max_length)


def encode_chat(tokenizer, messages: Sequence[Mapping]) -> torch.Tensor:
    """(1, T) token ids of a conversation through the model's chat template, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:                           # a base model: plain text, turns one per line
        text = "\n".join(str(m["content"]) for m in messages)
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return ids


def check_conversation(messages: Sequence[Mapping], limits: Limits = Limits()) -> None:
    """An InputError unless the conversation ends in a user's message and stays within the limits (counted before
    tokenizing: a huge conversation costs nothing but this check)."""
    if not messages or messages[-1].get("role") != "user" or not str(messages[-1].get("content", "")).strip():
        raise InputError("The prompt is empty: type a message first.")
    if len(messages) > limits.max_messages:
        raise InputError(f"The conversation has {len(messages)} messages; this server takes at most "
                         f"{limits.max_messages}. Start a new chat.")
    chars = sum(len(str(m.get("content", ""))) for m in messages)
    if chars > limits.max_chars:
        raise InputError(f"The conversation is {chars:,} characters long; this server takes at most "
                         f"{limits.max_chars:,}. Shorten the prompt or start a new chat.")


def check_context(config: CacheConfig, context: int) -> None:
    """Full-precision parts are allocated up front (the sink) or soon (the window): a size beyond the model's
    context stores nothing more, but could take the server's memory (sink 10**9: 768 GB)."""
    for name in ("sink", "local_window", "page_size"):
        if getattr(config, name) > context:
            raise InputError(f"Custom method: {name}={getattr(config, name)} is larger than the model's context of "
                             f"{context} tokens.")


# ---------------------------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class TimelinePoint:
    elapsed_s: float                # since the method started (prefill included)
    tokens: int                     # generated so far
    kv_bytes: int
    tokens_per_s: float | None      # over the last SPEED_WINDOW tokens


@dataclass(frozen=True)
class KeyMagnitudes:
    """|K| of one layer as the cache holds it (sink and buffers exact, pages dequantized): (H, T, D)."""

    layer: int
    values: torch.Tensor


@dataclass(frozen=True)
class ForcedScore:
    """FP16's answer fed through one method's cache as decoding reads it (teacher forcing), right after the answers
    finished: the same prompt and the same tokens for every method, so only the cache differs. Unlike matching two
    free-running answers, one early difference does not spoil every later position."""

    positions: int                  # FP16 answer tokens scored
    top1_agreement: float           # share of positions where the method's top-1 token is FP16's
    kl: float                       # mean KL(FP16 || method), nats per token
    first_difference: int | None    # first position (0 = the answer's first token) whose top-1 differs; None: none
    fp16_token: str | None = None   # FP16's top-1 token there...
    method_token: str | None = None  # ...and the method's


@dataclass(frozen=True)
class MethodSnapshot:
    """One method's progress at one moment; a new object on every change, so readers never see a half update."""

    label: str
    config: CacheConfig
    status: str = "waiting"         # waiting | running | done | stopped | error
    error: str | None = None
    prompt_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    text: str = ""
    ttft_s: float | None = None     # start (prefill included) to the first new token
    elapsed_s: float = 0.0
    tokens_per_s: float | None = None   # decode speed after the first token
    kv_bytes: int = 0
    fp16_bytes: int = 0             # the same tokens' keys and values at 16 bits
    key_bits: float | None = None
    value_bits: float | None = None
    key_pages: int = 0
    value_pages: int = 0
    peak_memory_bytes: int | None = None
    timeline: tuple[TimelinePoint, ...] = ()
    boost_masks: tuple[torch.Tensor | None, ...] = ()       # per layer: (pages, H, D) bool of sequence 0
    page_magnitudes: tuple[torch.Tensor | None, ...] = ()   # per layer: (pages, H, D) mean |k| that chose them
    key_magnitudes: KeyMagnitudes | None = None              # the focused layer, refreshed every CAPTURE_EVERY
    agreement: float | None = None  # free-running token match: share of positions identical to FP16's answer
    diverges_at: int | None = None  # first token of this answer that differs from FP16's (free-running)
    divergence_chars: tuple[int, int] | None = None         # that token's characters in `text`
    projection: tuple[tuple[int, int, int], ...] = ()       # (tokens, bytes used, FP16 bytes) at 8K / 32K / 128K
    score_status: str = "none"      # pending | scoring | scored | reference | none | stopped | failed
    score: ForcedScore | None = None
    score_note: str | None = None   # why there is no score

    @property
    def finished(self) -> bool:
        """Its answer is complete (or cut short, or failed); scoring may still run."""
        return self.status in ("done", "stopped", "error")

    @property
    def settled(self) -> bool:
        """Nothing more will change: the answer finished and its scoring too."""
        return self.finished and self.score_status not in ("pending", "scoring")

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kv_ratio(self) -> float | None:
        """KV bytes relative to the same tokens at 16 bits (0.25 = a quarter of FP16)."""
        return self.kv_bytes / self.fp16_bytes if self.fp16_bytes else None

    @property
    def bits_per_element(self) -> float | None:
        if self.key_bits is None or self.value_bits is None:
            return None
        return (self.key_bits + self.value_bits) / 2

    def metrics(self) -> dict:
        """The scalar metrics, JSON-ready (the API's answer and the stored run)."""
        return {"status": self.status, "error": self.error, "prompt_tokens": self.prompt_tokens,
                "n_tokens": self.n_tokens, "tokens_per_s": self.tokens_per_s, "ttft_s": self.ttft_s,
                "total_s": self.elapsed_s, "kv_bytes": self.kv_bytes, "fp16_bytes": self.fp16_bytes,
                "kv_ratio": self.kv_ratio, "key_bits": self.key_bits, "value_bits": self.value_bits,
                "bits_per_element": self.bits_per_element, "key_pages": self.key_pages,
                "value_pages": self.value_pages, "peak_memory_bytes": self.peak_memory_bytes,
                "agreement": self.agreement, "diverges_at": self.diverges_at,
                "divergence_chars": None if self.divergence_chars is None else list(self.divergence_chars),
                "score_status": self.score_status, "score_note": self.score_note,
                "top1_agreement": None if self.score is None else self.score.top1_agreement,
                "kl_from_fp16": None if self.score is None else self.score.kl,
                "first_difference": None if self.score is None else self.score.first_difference,
                "scored_tokens": None if self.score is None else self.score.positions,
                "first_difference_tokens": None if self.score is None or self.score.first_difference is None
                else [self.score.fp16_token, self.score.method_token],
                "projected_kv_bytes": {str(tokens): used for tokens, used, _ in self.projection}}


def token_agreement(reference: Sequence[int], other: Sequence[int], final: bool = True) -> float | None:
    """Share of positions where both answers have the same token. Final answers: over the longer one (a
    shorter answer disagrees where it has no token). While streaming, or when either was stopped: over the tokens
    both have (a stopped answer is cut short, not wrong)."""
    common = min(len(reference), len(other))
    longest = max(len(reference), len(other))
    denominator = longest if final else common
    if not denominator:
        return None
    return sum(a == b for a, b in zip(reference[:common], other[:common])) / denominator


def first_divergence(reference: Sequence[int], other: Sequence[int], final: bool = True) -> int | None:
    """The first position where `other` has a token that differs from `reference` (its own token there, or, when
    final, the end of `other` if it stops before the reference); None while they agree."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    if final and len(other) > len(reference):
        return len(reference)
    return None


def memory_probe() -> tuple[str, Callable[[], int]]:
    """What 'peak memory' measures here, and how to read it. Both are process-wide: every method and every
    user of this process share one figure, so it says how much this machine needed, not one cache alone."""
    if torch.cuda.is_available():
        return "peak GPU memory (whole process)", torch.cuda.memory_allocated
    process = psutil.Process()
    return "peak RSS (whole process)", lambda: process.memory_info().rss


# ---------------------------------------------------------------------------------------------- generation
class SeededSampler(LogitsProcessor):
    """Samples the next token with its own generator and hands greedy search a one-hot score row.

    transformers samples from the global RNG, which methods generating side by side in threads would share: no
    seed would reproduce a run. Here every method draws from its own generator seeded alike, so methods whose
    distributions agree draw the same tokens, and answers part only where a cache changed the distribution."""

    def __init__(self, settings: GenerationSettings, device: torch.device):
        self.warpers = [TemperatureLogitsWarper(settings.temperature)]
        if settings.top_k > 0:
            self.warpers.append(TopKLogitsWarper(settings.top_k))
        if settings.top_p < 1:
            self.warpers.append(TopPLogitsWarper(settings.top_p))
        self.generator = torch.Generator(device=device).manual_seed(settings.seed)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        choice = torch.multinomial(scores.softmax(-1), 1, generator=self.generator)
        return torch.full_like(scores, float("-inf")).scatter_(1, choice, 0.0)


class _StopFlag(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _Recorder(BaseStreamer):
    """Runs in the method's generation thread: records each token and the cache's state right after it."""

    def __init__(self, comparison: Comparison, label: str, cache, start: float):
        self.comparison, self.label, self.cache, self.start = comparison, label, cache, start
        self.prompt_seen = False
        self.token_ids: list[int] = []
        self.times: list[float] = []
        self.timeline: list[TimelinePoint] = []
        self.peak = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:            # generate() hands over the prompt first
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.token_ids.extend(int(t) for t in value.reshape(-1).tolist())
        self.times.append(now)
        self.comparison._publish(self.label, **self.progress(now))

    def end(self) -> None:
        pass

    def progress(self, now: float) -> dict:
        cmp = self.comparison
        stats = self.cache.stats()
        self.peak = max(self.peak, cmp._memory())
        n, times = len(self.token_ids), self.times
        window = min(SPEED_WINDOW, n - 1)
        rolling = window / (times[-1] - times[-1 - window]) if window > 0 and times[-1] > times[-1 - window] else None
        self.timeline.append(TimelinePoint(now - self.start, n, int(stats.bytes_used), rolling))
        masks, magnitudes = [None] * cmp.num_layers, [None] * cmp.num_layers
        for layer in stats.layers:
            if layer.kind == "kitty" and layer.boost_masks:
                masks[layer.index], magnitudes[layer.index] = layer.boost_masks[0], layer.magnitudes[0]
        update = dict(
            status="running", token_ids=tuple(self.token_ids),
            text=cmp.tokenizer.decode(self.token_ids, skip_special_tokens=True),
            ttft_s=times[0] - self.start, elapsed_s=now - self.start,
            tokens_per_s=(n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
            kv_bytes=int(stats.bytes_used), fp16_bytes=int(stats.fp16_bytes),
            key_bits=float(stats.key_bits), value_bits=float(stats.value_bits),
            key_pages=int(stats.key_pages), value_pages=int(stats.value_pages),
            peak_memory_bytes=self.peak, timeline=tuple(self.timeline),
            boost_masks=tuple(masks), page_magnitudes=tuple(magnitudes))
        focus_label, focus_layer = cmp.focus
        if focus_label == self.label and (n == 1 or n % CAPTURE_EVERY == 0 or
                                          cmp._captured_layer(self.label) != focus_layer):
            update["key_magnitudes"] = layer_key_magnitudes(self.cache, focus_layer)
        return update


def layer_key_magnitudes(cache, layer_index: int) -> KeyMagnitudes | None:
    """|K| (H, T, D) of sequence 0 in one layer of a KittyCache, or None if that layer holds nothing yet."""
    if not 0 <= layer_index < len(cache.layers):
        return None
    layer = cache.layers[layer_index]
    if not isinstance(layer, KittyLayer) or not layer.is_initialized:   # e.g. a sliding-window layer
        return None
    keys, _ = gather_kv(layer.paged(), 0, torch.float32)
    return KeyMagnitudes(layer_index, keys.abs().to(torch.float16).cpu())


@dataclass
class _Job:
    label: str
    config: CacheConfig
    input_ids: torch.Tensor
    thread: threading.Thread | None = None
    cache: object = None


class _Stopped(Exception):
    """Stop was pressed during a teacher-forced pass."""


class Comparison:
    """Several methods generating for the same conversation at the same time, one thread each. When FP16 is one
    of them, each thread then scores FP16's answer through its method's cache (teacher forcing): the passes start
    once every answer is complete, so no pass slows down an answer still generating (tokens/s stays fair)."""

    def __init__(self, model, tokenizer, jobs: Sequence[_Job], settings: GenerationSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.memory_label, self._memory = memory_probe()
        self._jobs = {job.label: job for job in jobs}
        scored = REFERENCE in self._jobs and len(self._jobs) > 1
        self._snapshots = {job.label: MethodSnapshot(job.label, job.config, prompt_tokens=job.input_ids.shape[1],
                                                     projection=memory.projection(job.config, model.config),
                                                     score_status="pending" if scored else "none",
                                                     score_note=None if scored else "no FP16 answer to score against")
                           for job in jobs}
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._generated = threading.Event()             # every answer is complete: the scoring passes may start
        self._reference_ready = threading.Event()       # FP16's teacher-forced log-probabilities are known...
        self._reference: torch.Tensor | None = None     # ...(positions, vocab), or None (FP16 failed or stopped)
        self._divergence_spans: dict[tuple[str, int], tuple[int, int] | None] = {}
        self._started = False
        self.released = False
        self.focus: tuple[str | None, int] = (None, 0)     # no live capture unless someone watches a layer

    @property
    def labels(self) -> list[str]:
        return list(self._jobs)

    # -------------------------------------------------------------------- control
    def start(self) -> Comparison:
        if not self._started:
            self._started = True
            use_kitty_attention(self.model)     # once here, not from every thread's make_cache at the same moment
            for job in self._jobs.values():
                job.thread = threading.Thread(target=self._run, args=(job,), name=f"generate-{job.label}",
                                              daemon=True)
                job.thread.start()
        return self

    def stop(self) -> None:
        """Ask every method to stop after its current step (their answers so far are kept), scoring included."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        """Stop was pressed (or the client went away) before everything settled."""
        return self._stop.is_set()

    def join(self, timeout: float | None = None) -> None:
        for job in self._jobs.values():
            if job.thread is not None:
                job.thread.join(timeout)

    @property
    def finished(self) -> bool:
        """Every answer is complete and scored (or will not be)."""
        return all(s.settled for s in self._snapshots.values())

    def set_focus(self, label: str | None, layer: int) -> None:
        """Which method and layer the live key-magnitude capture follows (cheap to change at any time)."""
        self.focus = (label, int(layer))

    # -------------------------------------------------------------------- results
    def snapshots(self) -> dict[str, MethodSnapshot]:
        """Every method's latest snapshot, with its free-running match with the reference (fp16) answer and the
        first token where it parts from it."""
        with self._lock:
            snaps = dict(self._snapshots)
        ref = snaps.get(REFERENCE)
        if ref is None or ref.status == "error":
            return snaps
        for label, snap in snaps.items():
            final = ref.finished and snap.finished and "stopped" not in (ref.status, snap.status)
            at = None if label == REFERENCE else first_divergence(ref.token_ids, snap.token_ids, final)
            snaps[label] = replace(snap, agreement=token_agreement(ref.token_ids, snap.token_ids, final),
                                   diverges_at=at, divergence_chars=None if at is None else
                                   self._divergence_span(label, snap.token_ids, at))
        return snaps

    def _divergence_span(self, label: str, token_ids: Sequence[int], at: int) -> tuple[int, int] | None:
        """Characters of token `at` in the decoded answer (decoded once per method: a divergence never moves).
        None where the tokens do not decode to whole characters on their own (half of a multi-byte character)."""
        if (label, at) not in self._divergence_spans:
            before = self.tokenizer.decode(token_ids[:at], skip_special_tokens=True)
            through = self.tokenizer.decode(token_ids[:at + 1], skip_special_tokens=True)
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            whole = text.startswith(through) and through.startswith(before) and len(through) > len(before)
            self._divergence_spans[(label, at)] = (len(before), len(through)) if whole else None
        return self._divergence_spans[(label, at)]

    def updates(self, interval: float = 0.15) -> Iterator[dict[str, MethodSnapshot]]:
        """Snapshots of all methods whenever any of them progressed, at most one per `interval` seconds, ending
        with the final state. Closing the iterator early (the page went away) stops the methods."""
        self.start()
        last_yield = 0.0
        try:
            while True:
                self._events.get()                          # block until some method progressed
                time.sleep(max(0.0, interval - (time.perf_counter() - last_yield)))
                while not self._events.empty():             # merge everything that arrived meanwhile
                    self._events.get_nowait()
                done = self.finished
                last_yield = time.perf_counter()
                yield self.snapshots()
                if done:
                    return
        finally:
            if not self.finished:
                self.stop()

    def run(self) -> dict[str, MethodSnapshot]:
        """Generate to the end and return the final snapshots."""
        self.start()
        self.join()
        return self.snapshots()

    def key_magnitudes(self, label: str, layer: int) -> KeyMagnitudes | None:
        """|K| of one layer of one method: from its final cache once it finished (None after `release`), else
        the last live capture (None when that capture was of another layer)."""
        job, snap = self._jobs.get(label), self._snapshots.get(label)
        if job is None or snap is None:
            return None
        if snap.finished:
            return None if job.cache is None else layer_key_magnitudes(job.cache, layer)
        captured = snap.key_magnitudes
        return captured if captured is not None and captured.layer == layer else None

    def held_bytes(self) -> int:
        """What the methods' caches have allocated (0 once released): the cost of keeping them for re-plotting."""
        return sum(int(cache.stats().bytes_reserved) for cache in (job.cache for job in self._jobs.values())
                   if cache is not None)

    def release(self) -> None:
        """Drop the finished methods' caches (their memory); snapshots and metrics stay."""
        self.released = True
        for job in self._jobs.values():
            job.cache = None

    # -------------------------------------------------------------------- worker side
    def _captured_layer(self, label: str) -> int | None:
        captured = self._snapshots[label].key_magnitudes
        return None if captured is None else captured.layer

    def _publish(self, label: str, **changes) -> None:
        with self._lock:
            self._snapshots[label] = replace(self._snapshots[label], **changes)
        self._events.put(label)

    def _run(self, job: _Job) -> None:
        share_cpu(len(self._jobs))                  # every method's thread runs at once: split the cores among them
        try:
            self._generate(job)
        finally:
            with self._lock:
                generated = all(s.finished for s in self._snapshots.values())
            if generated:
                self._generated.set()
        if self._snapshots[job.label].score_status == "pending":
            self._score(job)
            if self.finished:
                self._reference = None          # (positions, vocab) floats: no longer needed once all compared

    def _generate(self, job: _Job) -> None:
        start = time.perf_counter()
        try:
            self._publish(job.label, status="running")
            job.cache = make_cache(self.model, job.config)
            recorder = _Recorder(self, job.label, job.cache, start)
            device = self.model.device
            processors = LogitsProcessorList([SeededSampler(self.settings, device)] if self.settings.sample else [])
            self.model.generate(
                input_ids=job.input_ids.to(device), attention_mask=torch.ones_like(job.input_ids).to(device),
                past_key_values=job.cache, max_new_tokens=self.settings.max_new_tokens, do_sample=False,
                logits_processor=processors, stopping_criteria=StoppingCriteriaList([_StopFlag(self._stop)]),
                streamer=recorder, pad_token_id=self.tokenizer.pad_token_id)
            self._publish(job.label, status="stopped" if self._stop.is_set() else "done",
                          elapsed_s=time.perf_counter() - start)
        except torch.OutOfMemoryError as exc:
            job.cache = None                                # free what this method held
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._publish(job.label, status="error", error=f"Out of memory: {first_line}".rstrip(": "),
                          elapsed_s=time.perf_counter() - start)
        except Exception as exc:                            # one method's failure must not end the others
            log.exception("method %s failed", job.label)
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self._publish(job.label, status="error", error=message, elapsed_s=time.perf_counter() - start)

    # -------------------------------------------------------------------- teacher-forced scoring
    def _until(self, event: threading.Event) -> bool:
        """Wait for `event`; False if Stop comes first."""
        while not event.wait(0.1):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _score(self, job: _Job) -> None:
        """Feed FP16's answer through a fresh cache of this method; FP16's own pass is the reference."""
        label, is_reference = job.label, job.label == REFERENCE
        if not self._until(self._generated):
            return self._unscored(label, "stopped", "Stop was pressed before scoring")
        reference, own = self._snapshots[REFERENCE], self._snapshots[label]
        why = ("this method failed" if own.status == "error" else
               "FP16 failed, so there is nothing to score against" if reference.status == "error" else
               "FP16 wrote no tokens" if not reference.token_ids else None)
        if why:
            return self._unscored(label, "none", why)
        self._publish(label, score_status="scoring", score_note="scoring FP16's answer through this cache")
        prompt = self._jobs[REFERENCE].input_ids
        ids = torch.cat([prompt, torch.tensor([reference.token_ids], dtype=prompt.dtype)], dim=1)

        def check_stop(step: int, steps: int) -> None:
            if self._stop.is_set():
                raise _Stopped
            self._publish(label, score_note=f"scoring: {step} of {steps} tokens")
        try:
            logprobs = teacher_forced_logprobs(self.model, ids, make_cache(self.model, job.config),
                                               prefix=prompt.shape[1], progress=check_stop)
        except _Stopped:
            logprobs = None
        except Exception as exc:                            # e.g. out of memory: the answer stands, unscored
            log.exception("scoring %s failed", label)
            logprobs = None
            self._unscored(label, "failed", f"scoring failed ({type(exc).__name__}: {exc})")
        if is_reference:
            self._reference = logprobs
            self._reference_ready.set()
            if logprobs is not None:
                self._publish(label, score_status="reference", score_note=None,
                              score=ForcedScore(logprobs.shape[0], 1.0, 0.0, None))
        if logprobs is None or is_reference:
            if self._stop.is_set():
                self._unscored(label, "stopped", "Stop was pressed while scoring")
            return None
        if not self._until(self._reference_ready) or self._reference is None:
            return self._unscored(label, "stopped" if self._stop.is_set() else "failed",
                                  "Stop was pressed while scoring" if self._stop.is_set() else
                                  "FP16's own pass failed")
        self._publish(label, score_status="scored", score_note=None, score=self._compare(self._reference, logprobs))
        return None

    def _compare(self, reference: torch.Tensor, logprobs: torch.Tensor) -> ForcedScore:
        top_reference, top = reference.argmax(-1), logprobs.argmax(-1)
        differs = (top_reference != top).nonzero()
        first = int(differs[0]) if len(differs) else None
        decode = self.tokenizer.decode
        return ForcedScore(positions=reference.shape[0], top1_agreement=(top_reference == top).float().mean().item(),
                           kl=max(0.0, mean_kl(reference, logprobs)),      # exact zero, never -1e-9
                           first_difference=first,
                           fp16_token=None if first is None else decode([int(top_reference[first])]),
                           method_token=None if first is None else decode([int(top[first])]))

    def _unscored(self, label: str, status: str, why: str) -> None:
        self._publish(label, score_status=status, score_note=why, score=None)


def prepare_comparison(model, tokenizer, conversations: Sequence[Mapping] | Mapping[str, Sequence[Mapping]],
                       methods: Mapping[str, CacheConfig], settings: GenerationSettings, *,
                       limits: Limits = Limits(), max_new_tokens_cap: int | None = None) -> Comparison:
    """Check a request against the limits and the model's context, and tokenize it; raises InputError with a
    message for the user. Nothing is allocated until the comparison starts. `conversations` is one chat for every
    method, or one per method label (multi-turn chats, where each method saw its own answers).
    `max_new_tokens_cap` overrides limits.max_new_tokens."""
    if max_new_tokens_cap is not None:
        limits = replace(limits, max_new_tokens=max_new_tokens_cap)
    settings.validate(limits.max_new_tokens)
    if not methods:
        raise InputError("Choose at least one method to compare.")
    if len(methods) > MAX_METHODS:
        raise InputError(f"Choose at most {MAX_METHODS} methods per comparison (got {len(methods)}).")
    context = model_context(model, tokenizer)
    for config in methods.values():
        check_context(config, context)
    jobs = []
    for label, config in methods.items():
        messages = conversations[label] if isinstance(conversations, Mapping) else conversations
        check_conversation(messages, limits)
        ids = encode_chat(tokenizer, messages)
        if ids.shape[1] >= context:
            raise InputError(f"The prompt is {ids.shape[1]} tokens long, longer than the model's context of "
                             f"{context} tokens. Shorten it or start a new chat.")
        if ids.shape[1] + settings.max_new_tokens > context:
            raise InputError(f"The prompt is {ids.shape[1]} tokens; with {settings.max_new_tokens} new tokens "
                             f"that exceeds the model's context of {context} tokens. Shorten the prompt, start a "
                             f"new chat or lower max new tokens.")
        jobs.append(_Job(label, config, ids))
    return Comparison(model, tokenizer, jobs, settings)


__all__ = ["Comparison", "GenerationSettings", "InputError", "KeyMagnitudes", "Limits", "MethodSnapshot",
           "TimelinePoint", "DEFAULT_MAX_NEW_TOKENS_CAP", "MAX_METHODS", "MAX_SEED", "REFERENCE", "CUSTOM",
           "describe_config", "has_boost", "prepare_comparison", "resolve_methods", "token_agreement",
           "first_divergence", "ForcedScore", "layer_key_magnitudes", "encode_chat", "model_context",
           "memory_probe", "SeededSampler"]
