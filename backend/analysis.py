"""Quality measurements of cache methods on a loaded model (the teaching suite and the quality tests).

Teacher forcing feeds a fixed text through a cache exactly as generation would read it (chunks between page
boundaries, each token seeing what it would see when decoded), and keeps each position's next-token
distribution: the KL divergence from the FP16 run and the perplexity of the text measure what quantizing the
cache costs. The pass-key test hides a number in filler text and asks for it.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch


DATA = Path(__file__).parent / "data"


def bundled_text() -> str:
    """The opening of Alice's Adventures in Wonderland (Lewis Carroll, 1865; public domain)."""
    return (DATA / "alice.txt").read_text()


def page_lengths(cache, start: int, end: int) -> list[int] | None:
    """The cache lengths in (start, end) at which decoding one token at a time would turn buffered tokens into a
    page: those of a KittyCache with the paper's schedule (flush_spread 1, or "auto" for one sequence), whose key
    pages form at lengths sink + k * G and value pages at sink + R + k * G. Between two of them a chunk of tokens
    sees exactly the cache that each of its tokens would see when decoded. None for other caches and for those that
    decode with the 8-bit kernels (fed one token at a time)."""
    from kernels.decode_attention import kernel_parts
    from kernels.i8_reference import I8_KERNELS

    from .cache import KittyCache, KittyLayer
    if not isinstance(cache, KittyCache):
        return None
    lengths = set()
    for layer in cache.layers:
        if not isinstance(layer, KittyLayer):               # transformers' sliding-window layers: no pages
            continue
        # one sequence (teacher forcing): "auto" is the paper's schedule until a layer has seen its batch. A chunk
        # is attended with exact arithmetic: the 8-bit kernels' numbers come from decode steps alone
        if layer.flush_spread not in (1, "auto") or kernel_parts(layer.decode_kernel)[0] in I8_KERNELS:
            return None
        cfg = layer.config
        first = [cfg.sink + cfg.page_size] * (cfg.k_bits < 16) + \
                [cfg.sink + cfg.local_window + cfg.page_size] * (cfg.v_bits < 16)
        for length in first:
            lengths.update(range(length, end, cfg.page_size))
    return sorted(n for n in lengths if start < n < end)


@torch.no_grad()
def teacher_forced_logprobs(model, input_ids: torch.Tensor, cache, prefix: int = 16,
                            progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Log-probabilities (T - prefix, vocab) of each next token, the first `prefix` tokens as a prompt and the
    rest read as decoding would read them through `cache` (a KittyCache, a DynamicCache, ...). A KittyCache takes
    the tokens between two page boundaries as one chunk (page_lengths): the same cache contents per token as one
    decode step each, in a handful of forward passes instead of one per token. Other caches: one token a step.
    `progress(tokens fed, tokens to feed)` after each pass."""
    ids = input_ids.to(model.device)
    out = model(ids[:, :prefix], past_key_values=cache, use_cache=True)
    rows = [out.logits[0, -1:].float().log_softmax(-1)]
    end = ids.shape[1] - 1                                   # the last token's prediction is not needed
    cuts = page_lengths(cache, prefix, end)
    cuts = range(prefix + 1, end) if cuts is None else cuts
    bounds = [prefix, *cuts, end] if end > prefix else [prefix]
    for a, b in zip(bounds, bounds[1:]):
        out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
        rows.append(out.logits[0].float().log_softmax(-1))
        if progress:
            progress(b - prefix, end - prefix)
    return torch.cat(rows).cpu()


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other), both log-probabilities (T, vocab)."""
    return (reference.exp() * (reference - other)).sum(-1).mean().item()


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean negative log-likelihood) of `targets` (T,) under teacher-forced `logprobs` (T, vocab)."""
    return logprobs.gather(1, targets[:, None].cpu()).neg().mean().exp().item()


ANSWER_START = "The secret number is"


def story_sentences() -> list[str]:
    """The bundled text cut into sentences: the filler of the pass-key prompts."""
    return [s.strip() + "." for s in bundled_text().replace("\n", " ").split(".") if s.strip()]


def passkey_prompt(tokenizer, depth: float, filler_sentences: int = 60, seed: int = 0) -> tuple[list[dict], str]:
    """A chat hiding a 5-digit secret number at `depth` (0 = start, 1 = end) of `filler_sentences` sentences of
    the bundled story (repeated as needed), asking for it, with the answer's start given (encode it with
    passkey_ids). Measured on the default model (SmolLM2-135M-Instruct, CPU, 2026-11-30): with repetitive filler
    ("The grass is green. ...") and an open question, FP16 itself lost the key at 2-4K tokens (2 of 6, answering
    "a special key that is used to unlock..."); with the story and the answer's start it found 6 of 6 at 1K, 2K
    and 4K tokens."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    story = story_sentences()
    parts = [story[i % len(story)] for i in range(filler_sentences)]
    parts.insert(round(depth * filler_sentences), f"The secret number is {key}.")
    text = "Read the text below and remember the secret number in it.\n\n" + " ".join(parts) + \
        "\n\nWhat is the secret number?"
    return [{"role": "user", "content": text}, {"role": "assistant", "content": ANSWER_START}], key


def passkey_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """(1, T) ids of a passkey_prompt chat, the assistant's turn continuing from its given start."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, continue_final_message=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
