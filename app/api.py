"""The JSON API: `/compare` runs one comparison to the end and returns every answer with its metrics.

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860/")
    result = client.predict("Why is the sky blue?", ["fp16", "kivi-k2v2", "kitty"], '{"max_new_tokens": 32}',
                            api_name="/compare")
    result["results"]["kitty"]["text"], result["results"]["kitty"]["agreement"], result["run_slug"]

It shares the "generate" queue with the page's Send button, so API calls and browser users wait in one line.
"""
# No `from __future__ import annotations`: gr.api reads the signature's types to describe the endpoint.
import json

import gradio as gr

from backend.engine import GenerationSettings, InputError, prepare_comparison, resolve_methods
from storage import StorageError

from .services import Services


def _history(value) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and m.get("role") in ("user", "assistant")
                                              and isinstance(m.get("content"), str) for m in value):
        raise InputError('"history" must be a list of {"role": "user" | "assistant", "content": "..."} messages')
    return [{"role": m["role"], "content": m["content"]} for m in value]


def make_compare(services: Services):
    def compare(prompt: str, methods: list[str], settings: str = "{}") -> dict:
        """Compare KV cache methods on one prompt.

        Args:
            prompt: the user's message.
            methods: method names: fp16, kivi-k2v2, kivi-k2v2*, kivi-k2v4*, kivi-k4v2*, kivi-k4v4, kitty, kitty-pro,
                custom.
            settings: a JSON object: max_new_tokens, sample (bool), temperature, top_p, top_k, seed; "custom":
                {k_bits, v_bits, sink, page_size, local_window, alpha, selection} for the custom method;
                "history": earlier chat messages; "model": a model id where the operator allows it.
        Returns:
            {"model", "run_slug", "permalink", "warning", "results": {method: {"text", "token_ids", "status",
            "error", "tokens_per_s", "ttft_s", "kv_bytes", "fp16_bytes", "kv_ratio", "key_bits", "value_bits",
            "peak_memory_bytes", "agreement", ...}}}
        """
        try:
            try:
                data = json.loads(settings or "{}")
            except json.JSONDecodeError as exc:
                raise InputError(f"settings must be a JSON object: {exc}") from exc
            if not isinstance(data, dict):
                raise InputError("settings must be a JSON object, e.g. {\"max_new_tokens\": 32}")
            model_name, custom = data.pop("model", None), data.pop("custom", None)
            history = _history(data.pop("history", []))
            generation = GenerationSettings.from_dict(data)
            configs = resolve_methods(methods, custom)
            model, tokenizer = services.models.get(model_name)
            messages = history + [{"role": "user", "content": (prompt or "").strip()}]
            comparison = prepare_comparison(model, tokenizer, messages, configs, generation,
                                            max_new_tokens_cap=services.config.max_new_tokens_cap)
        except InputError as exc:
            raise gr.Error(str(exc)) from None
        snaps = comparison.run()
        slug, warning = None, None
        try:
            slug = services.runlog.save(model.kitty_model_name, messages, generation, snaps,
                                        comparison.memory_label).slug
        except StorageError as exc:
            warning = f"The run was not saved: {exc}"
        return {"model": model.kitty_model_name, "run_slug": slug, "permalink": f"/?run={slug}" if slug else None,
                "warning": warning, "memory_label": comparison.memory_label,
                "results": {label: {"text": snap.text, "token_ids": list(snap.token_ids), **snap.metrics()}
                            for label, snap in snaps.items()}}

    return compare
