"""Cache methods: one config type and the named presets users type.

Every method is the same machinery with other settings (ARCHITECTURE.md): FP16 is "16 bits everywhere",
KIVI is Kitty with no boost, Kitty / Kitty-Pro boost the top alpha of key channels of each page to 4 bits, and
Kitty-Q / Kitty-Pro-Q choose those channels query-aware instead of by magnitude.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

SUPPORTED_BITS = (2, 4, 16)
SELECTIONS = ("magnitude", "random", "query")


@dataclass(frozen=True)
class CacheConfig:
    """Settings of one KV cache method.

    k_bits / v_bits: 2, 4 or 16 (16 = never quantized).
    sink: the first `sink` tokens of a sequence stay full precision (keys and values).
    page_size: G, tokens per quantized page; also the key Q-buffer size.
    local_window: R, most recent value tokens kept full precision.
    alpha: fraction of key channels boosted from 2 to 4 bits in every key page (ceil(alpha * head_dim)).
    selection: how boosted channels are chosen: "magnitude" (mean |k| over the page), "random", or "query"
        (query-aware: the mean q_c^2 of the queries seen so far times the channel's 2-bit error on the page).
    seed: seeds the random channel selection, so runs are reproducible.
    """

    name: str = "custom"
    k_bits: int = 2
    v_bits: int = 2
    sink: int = 32
    page_size: int = 128
    local_window: int = 128
    alpha: float = 0.0
    selection: str = "magnitude"
    seed: int = 0

    def __post_init__(self):
        for field in ("k_bits", "v_bits"):
            bits = getattr(self, field)
            if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
                raise ValueError(f"{field}={bits!r} is not supported: choose one of {SUPPORTED_BITS}")
        for field in ("sink", "page_size", "local_window"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{field}={value!r} must be an integer")
            if value < 0:
                raise ValueError(f"{field}={value} must not be negative")
        if self.page_size < 4 or self.page_size % 4:
            raise ValueError(f"page_size={self.page_size} must be a positive multiple of 4 (4 tokens per byte)")
        if self.page_size > 1024:
            raise ValueError(f"page_size={self.page_size} is larger than the supported 1024 tokens")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha!r} must be a number in [0, 1]")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} must be one of {SELECTIONS}")
        if self.alpha > 0 and self.k_bits != 2:
            raise ValueError(f"alpha={self.alpha} boosts 2-bit key channels, but k_bits={self.k_bits}")

    def boosted_channels(self, head_dim: int) -> int:
        """Rows of the high-bits plane of a key page: all channels at 4 bits, ceil(alpha * D) at 2 bits."""
        if self.k_bits == 4:
            return head_dim
        if self.k_bits == 2:
            return min(head_dim, math.ceil(self.alpha * head_dim - 1e-9))
        return 0

    @property
    def is_full_precision(self) -> bool:
        return self.k_bits == 16 and self.v_bits == 16

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, CacheConfig] = {
    "fp16": CacheConfig("fp16", k_bits=16, v_bits=16, sink=0),
    "kivi-k2v2": CacheConfig("kivi-k2v2", k_bits=2, v_bits=2, sink=0),
    "kivi-k2v2*": CacheConfig("kivi-k2v2*", k_bits=2, v_bits=2, sink=32),
    "kivi-k2v4*": CacheConfig("kivi-k2v4*", k_bits=2, v_bits=4, sink=32),
    "kivi-k4v2*": CacheConfig("kivi-k4v2*", k_bits=4, v_bits=2, sink=32),
    "kivi-k4v4": CacheConfig("kivi-k4v4", k_bits=4, v_bits=4, sink=0),
    "kitty": CacheConfig("kitty", k_bits=2, v_bits=2, sink=32, alpha=0.125),
    "kitty-pro": CacheConfig("kitty-pro", k_bits=2, v_bits=2, sink=32, alpha=0.25),
    # Beyond the paper: the same budgets with query-aware channels (BENCHMARKS.md section 5: on the default model
    # kitty-q reaches kitty-pro's perplexity with kitty's memory)
    "kitty-q": CacheConfig("kitty-q", k_bits=2, v_bits=2, sink=32, alpha=0.125, selection="query"),
    "kitty-pro-q": CacheConfig("kitty-pro-q", k_bits=2, v_bits=2, sink=32, alpha=0.25, selection="query"),
}
METHODS: tuple[str, ...] = tuple(PRESETS)


def method_config(name: str = "custom", **overrides) -> CacheConfig:
    """The config of a preset (optionally with some settings changed), or a custom one from keyword settings."""
    unknown = set(overrides) - set(CacheConfig.__dataclass_fields__) - {"name"}
    if unknown:
        raise ValueError(f"unknown cache setting(s): {', '.join(sorted(unknown))}")
    if name == "custom":
        return CacheConfig(**{"name": "custom", **overrides})
    if name not in PRESETS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(METHODS)} or 'custom'")
    if not overrides:
        return PRESETS[name]
    return replace(PRESETS[name], **{"name": f"{name} (custom)", **overrides})
