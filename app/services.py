"""What the page's handlers share: the operator's settings, the loaded models, the run log and the caches that
finished comparisons keep for re-plotting."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from backend import DEFAULT_MODEL, load_model
from backend.engine import Comparison, InputError
from backend.model import is_hub_id

from .config import AppConfig
from .runlog import RunLog

log = logging.getLogger(__name__)


class ModelRegistry:
    """The default model, loaded at start-up, and other models loaded on demand (the `keep` most recently used
    of them stay in memory), as the operator's policy allows:

    - `allowed`: hub ids and local folders the operator listed, loaded as written;
    - `allow_any`: also any Hugging Face hub id, never a local path: a name that is not an id's shape is refused
      for that alone, and one that names something on this disk fails like an id the hub does not have, so no
      answer says what exists on the server.
    Remote code never runs (load_model sets trust_remote_code=False); load errors go to the server log only."""

    def __init__(self, default: str | None = None, allow_any: bool = False, keep: int = 1, loader=load_model,
                 allowed: tuple[str, ...] = ()):
        self.allow_any, self.keep, self.loader, self.allowed = allow_any, keep, loader, tuple(allowed)
        self._lock = threading.Lock()
        self._others: OrderedDict[str, tuple] = OrderedDict()
        self.default = loader(default)
        self.default_name = self.default[0].kitty_model_name

    def _is_default(self, name: str) -> bool:
        return name in ("", "default", DEFAULT_MODEL, self.default_name)

    def _may_load(self, name: str) -> bool:
        return name in self.allowed or (self.allow_any and is_hub_id(name))

    def needs_loading(self, name: str | None) -> bool:
        """Whether get(name) would load a model first (slow): an allowed model that is not in memory yet."""
        name = name.strip() if isinstance(name, str) else ""
        return not self._is_default(name) and self._may_load(name) and name not in self._others

    def get(self, name: str | None = None) -> tuple:
        """(model, tokenizer) for a model name; InputError when the policy refuses it or it fails to load."""
        if name is not None and not isinstance(name, str):
            raise InputError(f"The model must be a name, e.g. \"{self.default_name}\" (got {name!r}).")
        name = (name or "").strip()
        if self._is_default(name):
            return self.default
        if not self._may_load(name):
            raise InputError(self._refusal(name))
        with self._lock:                # one load at a time; a second request for it waits and reuses it
            if name not in self._others:
                try:
                    if name not in self.allowed and Path(name).exists():
                        raise FileNotFoundError(f"{name!r} names a local path, not a hub id")
                    self._others[name] = self.loader(name)
                except Exception as exc:         # a bad id, no network, an unsupported architecture, a local path
                    log.warning("could not load model %r: %s", name, exc)
                    raise InputError(f"Could not load the model {name!r}: the Hugging Face hub does not have it, "
                                     f"it could not be reached, or it is not a causal language model this server "
                                     f"can run (the server log has the details).") from None
                while len(self._others) > self.keep:
                    self._others.popitem(last=False)
            self._others.move_to_end(name)
            return self._others[name]

    def _refusal(self, name: str) -> str:
        shown = name if len(name) <= 60 else name[:60] + "…"
        offered = ", ".join([self.default_name, *self.allowed])
        if self.allow_any:
            return (f"{shown!r} is not a Hugging Face model id (like \"Qwen/Qwen3-0.6B\"); this server loads hub ids "
                    f"and these models: {offered}.")
        if self.allowed:
            return f"This server does not offer {shown!r}: choose one of {offered}."
        return (f"This server only serves {self.default_name}: the operator has not allowed other models "
                f"(python app.py --allow-model NAME or --allow-any-model).")


class KeptCaches:
    """Finished comparisons whose caches stay so that an idle tab's plots can still explore any layer: the newest
    ones, at most `max_count` of them and `max_bytes` of cache memory together (all users); older ones are
    released, and one that alone exceeds the budget is released at once."""

    def __init__(self, max_bytes: int, max_count: int = 8):
        self.max_bytes, self.max_count = max_bytes, max_count
        self._kept: deque[tuple[Comparison, int]] = deque()
        self._lock = threading.Lock()

    def add(self, comparison: Comparison) -> None:
        size = comparison.held_bytes()
        with self._lock:
            self._kept.append((comparison, size))
            while self._kept and (len(self._kept) > self.max_count or self.held_bytes() > self.max_bytes):
                self._kept.popleft()[0].release()

    def held_bytes(self) -> int:
        return sum(size for _, size in self._kept)


@dataclass
class Services:
    config: AppConfig
    models: ModelRegistry
    runlog: RunLog
    kept: KeptCaches | None = None

    def __post_init__(self):
        if self.kept is None:
            self.kept = KeptCaches(self.config.keep_cache_mb * 2**20)

    @classmethod
    def start(cls, config: AppConfig) -> Services:
        models = ModelRegistry(config.model, config.allow_any_model, allowed=config.allowed_models)
        return cls(config, models, RunLog(config.db_url))
