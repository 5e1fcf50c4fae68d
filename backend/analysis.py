"""Quality measurements of cache methods on a loaded model (the teaching suite and the quality tests).

Teacher forcing feeds a fixed text one token per step through a cache, exactly as generation would read it,
and keeps each step's next-token distribution: the KL divergence from the FP16 run and the perplexity of the
text measure what quantizing the cache costs. The pass-key test hides a number in filler text and asks for it.
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


@torch.no_grad()
def teacher_forced_logprobs(model, input_ids: torch.Tensor, cache, prefix: int = 16,
                            progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Log-probabilities (T - prefix, vocab) of each next token, the first `prefix` tokens as a prompt and the
    rest one decode step at a time through `cache` (a KittyCache, a DynamicCache, ...)."""
    ids = input_ids.to(model.device)
    out = model(ids[:, :prefix], past_key_values=cache, use_cache=True)
    rows = [out.logits[0, -1].float().log_softmax(-1)]
    steps = ids.shape[1] - prefix - 1
    for i in range(steps):
        out = model(ids[:, prefix + i:prefix + i + 1], past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float().log_softmax(-1))
        if progress:
            progress(i + 1, steps)
    return torch.stack(rows).cpu()


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
