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


def passkey_prompt(tokenizer, depth: float, filler_sentences: int = 60, seed: int = 0) -> tuple[list[dict], str]:
    """A chat asking for a 5-digit pass key hidden at `depth` (0 = start, 1 = end) of repetitive filler text."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    parts = [filler] * filler_sentences
    parts.insert(round(depth * filler_sentences), f"The pass key is {key}. Remember it. {key} is the pass key.")
    text = ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
            + " ".join(parts) + "\nWhat is the pass key?")
    return [{"role": "user", "content": text}], key
