"""What the page's handlers share: the operator's settings, the loaded models and the run log."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from backend import DEFAULT_MODEL, load_model
from backend.engine import InputError

from .config import AppConfig
from .runlog import RunLog

log = logging.getLogger(__name__)


class ModelRegistry:
    """The default model, loaded at start-up, and (only when the operator allows it) other models loaded on
    demand, the `keep` most recently used of them kept in memory."""

    def __init__(self, default: str | None = None, allow_any: bool = False, keep: int = 1, loader=load_model):
        self.allow_any, self.keep, self.loader = allow_any, keep, loader
        self._lock = threading.Lock()
        self._others: OrderedDict[str, tuple] = OrderedDict()
        self.default = loader(default)
        self.default_name = self.default[0].kitty_model_name

    def _is_default(self, name: str) -> bool:
        return name in ("", "default", DEFAULT_MODEL, self.default_name)

    def needs_loading(self, name: str | None) -> bool:
        """Whether get(name) would load a model first (slow): an allowed model that is not in memory yet."""
        name = (name or "").strip()
        return self.allow_any and not self._is_default(name) and name not in self._others

    def get(self, name: str | None = None) -> tuple:
        """(model, tokenizer) for a model id; InputError when other models are not allowed or fail to load."""
        name = (name or "").strip()
        if self._is_default(name):
            return self.default
        if not self.allow_any:
            raise InputError(f"This server only serves {self.default_name}: the operator has not allowed other "
                             f"models (python app.py --allow-any-model).")
        with self._lock:                # one load at a time; a second request for it waits and reuses it
            if name not in self._others:
                try:
                    self._others[name] = self.loader(name)
                except Exception as exc:         # a bad id, no network, an unsupported architecture...
                    log.warning("could not load model %r: %s", name, exc)
                    raise InputError(f"Could not load the model {name!r}: {exc}") from exc
                while len(self._others) > self.keep:
                    self._others.popitem(last=False)
            self._others.move_to_end(name)
            return self._others[name]


@dataclass
class Services:
    config: AppConfig
    models: ModelRegistry
    runlog: RunLog

    @classmethod
    def start(cls, config: AppConfig) -> Services:
        return cls(config, ModelRegistry(config.model, config.allow_any_model), RunLog(config.db_url))
