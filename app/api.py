"""The JSON API: `/compare` runs one comparison to the end and returns every answer with its metrics.

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860/")
    result = client.predict("Why is the sky blue?", ["fp16", "kivi-k2v2", "kitty"], '{"max_new_tokens": 32}',
                            api_name="/compare")
    result["results"]["kitty"]["text"], result["results"]["kitty"]["agreement"], result["run_slug"]

It shares the "generate" queue with the page's Send button, so API calls and browser users wait in one line. It
streams the answers so far a few times a second (`client.submit(...)` sees them; `predict` returns the last, full
one): between two of them Gradio notices a client that went away, and the comparison stops as the page's Stop
stops it, and is logged as "cancelled".
"""
# No `from __future__ import annotations`: gr.api reads the signature's types to describe the endpoint.
import json
from collections.abc import Iterator

import gradio as gr

from backend.engine import Comparison, GenerationSettings, InputError, prepare_comparison, resolve_methods

from .services import Services

PROGRESS_EVERY_S = 0.25           # also how late the final answer may come after the last token


def _history(value) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                                              and isinstance(m.get("content"), str) for m in value):
        raise InputError('"history" must be a list of {"role": "user" | "assistant", "content": "..."} messages')
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _not_json(constant: str):
    raise InputError(f"settings: {constant} is not a number JSON allows")


def _settings(text) -> dict:
    if text is not None and not isinstance(text, str):
        raise InputError("settings must be a JSON object in a string, e.g. '{\"max_new_tokens\": 32}'")
    try:
        data = json.loads(text or "{}", parse_constant=_not_json)
    except ValueError as exc:            # bad JSON, or an integer of thousands of digits
        raise InputError(f"settings must be a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise InputError("settings must be a JSON object, e.g. {\"max_new_tokens\": 32}")
    return data


def _answer(model, comparison: Comparison, snaps, slug: str, outcome=None) -> dict:
    return {"model": model.kitty_model_name, "run_slug": slug, "permalink": f"/?run={slug}",
            "finished": outcome is not None, "saved": bool(outcome and outcome.saved),
            "warning": None if outcome is None or outcome.saved else outcome.note,
            "memory_label": comparison.memory_label,
            "results": {label: {"text": snap.text, "token_ids": list(snap.token_ids), **snap.metrics()}
                        for label, snap in snaps.items()}}


def make_compare(services: Services):
    def compare(prompt: str, methods: list[str], settings: str = "{}") -> Iterator[dict]:
        """Compare KV cache methods on one prompt.

        Args:
            prompt: the user's message.
            methods: method names: fp16, kivi-k2v2, kivi-k2v2*, kivi-k2v4*, kivi-k4v2*, kivi-k4v4, kitty, kitty-pro,
                kitty-q, kitty-pro-q, custom.
            settings: a JSON object: max_new_tokens, sample (bool), temperature, top_p, top_k, seed; "custom":
                {k_bits, v_bits, sink, page_size, local_window, alpha, selection, seed} for the custom method;
                "history": earlier chat messages; "model": a model the operator allows.
        Returns:
            {"model", "run_slug", "permalink", "finished", "saved", "warning" (why the run is not saved yet),
            "results": {method: {"text", "token_ids", "status", "error", "tokens_per_s", "ttft_s", "kv_bytes",
            "fp16_bytes", "kv_ratio", "key_bits", "value_bits", "peak_memory_bytes", "agreement" (free-running
            token match), "top1_agreement", "kl_from_fp16", "first_difference" (FP16's answer fed through the
            method's cache, once every answer is complete; "score_status" says how that went), ...}}}; the answers
            so far a few times a second, then the final one.
        """
        try:
            if not isinstance(prompt, str | None):
                raise InputError("The prompt must be text.")
            data = _settings(settings)
            model_name, custom = data.pop("model", None), data.pop("custom", None)
            history = _history(data.pop("history", []))
            generation = GenerationSettings.from_dict(data)
            configs = resolve_methods(methods, custom)
            model, tokenizer = services.models.get(model_name)
            messages = history + [{"role": "user", "content": (prompt or "").strip()}]
            comparison = prepare_comparison(model, tokenizer, messages, configs, generation,
                                            limits=services.config.limits)
        except InputError as exc:
            raise gr.Error(str(exc)) from None
        run = services.runlog.begin(model.kitty_model_name, messages, generation, comparison.labels)
        finished = False
        try:
            for snaps in comparison.updates(interval=PROGRESS_EVERY_S):
                if not comparison.finished:
                    yield _answer(model, comparison, snaps, run.slug)
            finished = True
        finally:
            if not finished:             # Gradio closed this generator: the client is gone or cancelled
                services.runlog.abandon(run, comparison)
        outcome = services.runlog.finish(run, snaps, comparison.memory_label)
        comparison.release()             # nobody plots an API run: its caches go now
        yield _answer(model, comparison, snaps, run.slug, outcome)

    return compare
