"""Quality on the default model (SmolLM2-135M-Instruct, real weights, float32 on the CPU).

Teacher forcing: the same ~1,000 tokens of English go through each cache one decode step at a time, and each
step's next-token distribution is compared with the full-precision one (KL divergence). The paper's ordering
must hold: kitty-pro < kitty < kivi-k2v2* < kivi-k2v2, and magnitude-chosen boosts beat random ones.
"""
from __future__ import annotations

import pytest
import torch
from conftest import REPORT, Fp16DynamicCache

from backend import make_cache
from backend.analysis import bundled_text, mean_kl, perplexity, teacher_forced_logprobs

TOKENS, PREFIX = 1040, 16


@pytest.mark.slow
def test_kl_from_fp16_orders_as_the_paper(default_model):
    model, tokenizer = default_model
    ids = tokenizer(bundled_text(), return_tensors="pt").input_ids[:, :TOKENS]
    assert ids.shape[1] == TOKENS
    with torch.no_grad():                       # FP16 reference: one causal forward over the whole text
        reference = model(ids).logits[0, PREFIX - 1:-1].float().log_softmax(-1)
    targets = ids[0, PREFIX:]
    runs = {"kitty-pro": {}, "kitty": {}, "kivi-k2v2*": {}, "kivi-k2v2": {}, "kitty (random channels)": None}
    kl, ppl = {}, {}
    for name, settings in runs.items():
        cache = make_cache(model, "kitty", selection="random", seed=0) if settings is None else make_cache(model, name)
        logprobs = teacher_forced_logprobs(model, ids, cache, prefix=PREFIX)
        kl[name], ppl[name] = mean_kl(reference, logprobs), perplexity(logprobs, targets)
    REPORT.append(f"teacher-forced KL from fp16 over {TOKENS - PREFIX} tokens of bundled text "
                  f"(fp16 perplexity {perplexity(reference, targets):.2f}):")
    REPORT.extend(f"  {name:26s} KL {kl[name]:.4f}   perplexity {ppl[name]:.2f}" for name in runs)
    assert kl["kitty-pro"] < kl["kitty"] < kl["kivi-k2v2*"] < kl["kivi-k2v2"], kl
    assert kl["kitty"] < kl["kitty (random channels)"], kl


def test_batched_prompts_match_single_runs(default_model):
    """A left-padded batch of three prompts (one longer than sink + page + window) gives each prompt the
    answer it gets alone. Batched matrix products round differently from single ones, so where a single run's
    top two logits are within 0.05 of each other (a near tie), the outputs may part ways: the comparison runs
    up to the first such step, and together the three comparisons must cover most of the answers."""
    model, tokenizer = default_model
    long_text = bundled_text()[:1500]
    prompts = ["What is the capital of France?", "Name three colours of the rainbow, briefly.",
               f"Summarize in one sentence:\n{long_text}"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    batch = tokenizer(chats, return_tensors="pt", padding=True)
    assert batch.input_ids.shape[1] > 32 + 128 + 128
    together = model.generate(**batch, past_key_values=make_cache(model, "kitty"), **kwargs)
    width = batch.input_ids.shape[1]
    compared = []
    for b, chat in enumerate(chats):
        one = tokenizer(chat, return_tensors="pt")
        alone = model.generate(**one, past_key_values=make_cache(model, "kitty"), **kwargs)
        a = alone.sequences[0, one.input_ids.shape[1]:]
        t = together.sequences[b, width:]
        steps = 0
        for step in range(min(len(a), len(t))):
            top2 = alone.logits[step][0].float().topk(2).values
            if a[step] != t[step]:
                assert top2[0] - top2[1] < 0.05, f"prompt {b} step {step}: different tokens without a near tie"
                break
            steps += 1
            if a[step] == tokenizer.eos_token_id:
                break
        compared.append(steps)
    REPORT.append(f"batched vs single kitty runs: identical tokens for the first {compared} steps of 24")
    assert min(compared) >= 4 and sum(compared) >= 36, compared


def test_fp16_preset_logits_identical_to_dynamic_cache(default_model):
    """Prefill, then 150 decode steps teacher-forced: every step's logits equal those of transformers'
    DynamicCache holding the tokens at FP16 (what the preset stores for this float32 model) bit for bit."""
    model, tokenizer = default_model
    ids = tokenizer(bundled_text(), return_tensors="pt").input_ids[:, :200]
    with torch.no_grad():
        caches = (Fp16DynamicCache(model.config), make_cache(model, "fp16"))
        logits = []
        for cache in caches:
            steps = [model(ids[:, :50], past_key_values=cache, use_cache=True).logits]
            steps += [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(50, 200)]
            logits.append(torch.cat(steps, dim=1))
    assert logits[0].shape == (1, 200, model.config.vocab_size)
    assert torch.equal(logits[0], logits[1])
