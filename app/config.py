"""Operator settings of the service: command-line flags, each with an environment variable as its default.

Private by default: it binds to 127.0.0.1 and serves only the default model. `--host 0.0.0.0` / KITTY_HOST (or
Gradio's own GRADIO_SERVER_NAME, which Hugging Face Spaces sets) or `--share` makes it public.

Other models (never with trust_remote_code): `--allow-model NAME` (repeatable) / KITTY_ALLOWED_MODELS (comma
separated) lists the hub ids and local folders users may load; `--allow-any-model` / KITTY_ALLOW_ANY_MODEL=1 adds
any Hugging Face hub id, downloaded from the hub, never a local path.

Limits on one request (checked before anything is allocated; the model's context bounds the rest): new tokens,
characters and messages of the conversation. `--keep-cache-mb` bounds the memory finished comparisons keep for
re-plotting.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from backend.engine import DEFAULT_MAX_NEW_TOKENS_CAP, Limits


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def _names(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


@dataclass(frozen=True)
class AppConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    model: str | None = None                 # None: the default model (SmolLM2-135M-Instruct)
    allow_any_model: bool = False            # any Hugging Face hub id (never a local path)
    allowed_models: tuple[str, ...] = ()     # hub ids and local folders users may load
    max_new_tokens_cap: int = DEFAULT_MAX_NEW_TOKENS_CAP
    max_prompt_chars: int = Limits.max_chars
    max_messages: int = Limits.max_messages
    keep_cache_mb: int = 512                 # caches of finished comparisons kept for re-plotting, all users
    compare_concurrency: int = 2             # comparisons (UI and API together) generating at once
    teaching_concurrency: int = 1            # teaching suites running at once
    default_concurrency: int = 8             # every other event: history reads, plot redraws, page loads
    db_url: str | None = None                # None: KITTY_DB_URL / KITTY_DB_PATH / data/kitty_lab.sqlite3

    @property
    def limits(self) -> Limits:
        return Limits(self.max_new_tokens_cap, self.max_prompt_chars, self.max_messages)


def parse_args(argv: list[str] | None = None) -> AppConfig:
    parser = argparse.ArgumentParser(description="Kitty Lab: compare KV cache methods side by side in a browser.")
    parser.add_argument("--host", default=os.environ.get("KITTY_HOST") or os.environ.get("GRADIO_SERVER_NAME")
                        or "127.0.0.1",
                        help="address to bind; 0.0.0.0 makes the page public (env KITTY_HOST or GRADIO_SERVER_NAME)")
    parser.add_argument("--port", type=int, default=_int("KITTY_PORT", _int("GRADIO_SERVER_PORT", 7860)),
                        help="port (env KITTY_PORT, default 7860)")
    parser.add_argument("--share", action="store_true", default=_flag("KITTY_SHARE"),
                        help="also open a public gradio.live link (env KITTY_SHARE=1)")
    parser.add_argument("--model", default=os.environ.get("KITTY_MODEL") or None,
                        help="model id or folder to serve (env KITTY_MODEL; default SmolLM2-135M-Instruct)")
    parser.add_argument("--allow-model", action="append", default=_names("KITTY_ALLOWED_MODELS"), metavar="NAME",
                        help="a hub id or local folder users may load; repeat for more (env KITTY_ALLOWED_MODELS, "
                             "comma separated)")
    parser.add_argument("--allow-any-model", action="store_true", default=_flag("KITTY_ALLOW_ANY_MODEL"),
                        help="also let users load any Hugging Face hub id, never a local path "
                             "(env KITTY_ALLOW_ANY_MODEL=1)")
    parser.add_argument("--max-new-tokens", type=int, default=_int("KITTY_MAX_NEW_TOKENS", DEFAULT_MAX_NEW_TOKENS_CAP),
                        help="cap on new tokens per answer (env KITTY_MAX_NEW_TOKENS)")
    parser.add_argument("--max-prompt-chars", type=int, default=_int("KITTY_MAX_PROMPT_CHARS", Limits.max_chars),
                        help="cap on the characters of a conversation, earlier turns included "
                             "(env KITTY_MAX_PROMPT_CHARS)")
    parser.add_argument("--max-messages", type=int, default=_int("KITTY_MAX_MESSAGES", Limits.max_messages),
                        help="cap on the messages of a conversation (env KITTY_MAX_MESSAGES)")
    parser.add_argument("--keep-cache-mb", type=int, default=_int("KITTY_KEEP_CACHE_MB", AppConfig.keep_cache_mb),
                        help="memory that finished comparisons may keep for re-plotting, all users together "
                             "(env KITTY_KEEP_CACHE_MB)")
    parser.add_argument("--compare-concurrency", type=int, default=_int("KITTY_COMPARE_CONCURRENCY", 2),
                        help="comparisons running at once; more wait in the queue (env KITTY_COMPARE_CONCURRENCY)")
    parser.add_argument("--teaching-concurrency", type=int, default=_int("KITTY_TEACHING_CONCURRENCY", 1),
                        help="teaching suites running at once (env KITTY_TEACHING_CONCURRENCY)")
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL of the run log (env KITTY_DB_URL)")
    args = parser.parse_args(argv)
    if min(args.max_new_tokens, args.max_prompt_chars, args.max_messages, args.compare_concurrency,
           args.teaching_concurrency) < 1 or args.keep_cache_mb < 0:
        parser.error("the limits and concurrency settings must be at least 1 (--keep-cache-mb at least 0)")
    return AppConfig(host=args.host, port=args.port, share=args.share, model=args.model,
                     allow_any_model=args.allow_any_model, allowed_models=tuple(args.allow_model),
                     max_new_tokens_cap=args.max_new_tokens, max_prompt_chars=args.max_prompt_chars,
                     max_messages=args.max_messages, keep_cache_mb=args.keep_cache_mb,
                     compare_concurrency=args.compare_concurrency, teaching_concurrency=args.teaching_concurrency,
                     db_url=args.db_url)
