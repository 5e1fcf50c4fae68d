"""The Compare tab's long example: a fact buried in a long document, where uniform 2-bit keys visibly go wrong while
Kitty holds, found by measuring the default model (SmolLM2-135M-Instruct, float32 on a CPU, greedy).

Measured on 2026-11-30, a pass key (60494) hidden in the bundled story (about 1,480 tokens with the question: 11
key pages of 128 tokens), asked "What is the pass key? Answer with the 5-digit number only." (14 new tokens):

    key at 30 % of the story: fp16 "The pass key is 60494."  kivi-k2v2 "The pass key is 6449."   kitty "...60494."
    key at 50 %:              fp16 "The pass key is 60494."  kivi-k2v2 "The pass to the next room is t..."
                              kitty "The pass key is 60494."
    key at 70 %:              all three find it

(`generate` alone, one method at a time, 1-2 torch threads.) Through the page (the three methods generating side by
side, 12 new tokens, default threads, tests/test_app_browser.py): fp16 and kitty "The pass key is 60494.",
kivi-k2v2 "The passable number is 60494."; teacher-forced against FP16's answer: kitty top-1 100 %, KL 0.058;
kivi-k2v2 top-1 83 %, KL 0.906. The exact words of the 2-bit answer move with the thread count (float sums in
another order); the gap in KL is the robust part.

Repetitive filler ("The grass is green. The sky is blue. ...", an open "What is the pass key?") did not serve: at
1,400-2,000 tokens FP16 itself mostly answered "a magical key ..." and the 2-bit caches failed or passed at random;
at 1,000 all three passed. The example uses the key at 50 %.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.analysis import bundled_text

KEY = "60494"
DEPTH = 0.5


@dataclass(frozen=True)
class Example:
    question: str
    document: str
    label: str


def buried_fact(depth: float = DEPTH) -> str:
    """The bundled story with the pass key hidden at `depth` (0 = start, 1 = end), between two sentences."""
    text = bundled_text()
    cut = text.rfind(". ", 0, int(depth * len(text))) + 2
    return text[:cut] + f"The pass key is {KEY}. Remember it. {KEY} is the pass key. " + text[cut:]


LONG_EXAMPLE = Example(
    question="What is the pass key? Answer with the 5-digit number only.",
    document=buried_fact(),
    label="Long: a pass key buried in a 1,480-token story (11 key pages). Measured: fp16 and kitty answer it, "
          "kivi-k2v2 garbles it (KL from FP16 0.91 vs kitty's 0.06)",
)
