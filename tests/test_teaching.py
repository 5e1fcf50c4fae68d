"""The Teaching tab's shipped results and the memory figures a visitor sees, on the default model."""
from __future__ import annotations

import json
from datetime import datetime

import pytest
import torch

from backend import make_cache, memory, method_config, teaching
from backend.analysis import bundled_text
from backend.model import DEFAULT_MODEL


def test_precomputed_results_are_shipped_with_their_provenance():
    """backend/data/teaching_precomputed.json: made by the documented command on the default model, with its date
    and machine; pass-key at several thousand tokens, counts that agree with the answers, one real page."""
    data = teaching.load_precomputed()
    assert data is not None, f"run {teaching.PRECOMPUTED_COMMAND}"
    assert data["schema"] == 1 and data["model"] == DEFAULT_MODEL and data["command"] == teaching.PRECOMPUTED_COMMAND
    assert datetime.fromisoformat(data["date"]).year >= 2026 and data["seconds"] > 0
    assert set(data["machine"]) >= {"device", "dtype", "torch", "transformers"}
    suite = data["suite"]
    assert suite["columns"] == teaching.SUITE_COLUMNS and suite["text_tokens"] >= 1000
    assert [row[0] for row in suite["rows"]] == ["fp16", *teaching.SUITE_METHODS]
    grid = data["passkey"]
    assert max(grid["lengths"]) >= 4096 and len(grid["depths"]) >= 3
    assert grid["questions"] == len(grid["depths"]) * len(grid["seeds"])
    assert list(grid["found"]) == list(teaching.PASSKEY_METHODS)
    for method, hits in grid["found"].items():
        for length, count in zip(grid["lengths"], hits):
            answers = [a for a in grid["answers"] if a["method"] == method and a["length"] == length]
            assert len(answers) == grid["questions"]
            assert count == sum(a["found"] for a in answers) == sum(teaching.key_found(a["key"], a["answer"]) for a in answers)
    anatomy = data["anatomy"]
    d = len(anatomy["magnitudes"])
    assert len(anatomy["boosted"]) == -(-d // 8) and set(anatomy["boosted"]) <= set(range(d))
    assert anatomy["loud"]["mean_abs"] > anatomy["quiet"]["mean_abs"]
    assert anatomy["loud"]["error_two_bit"] > anatomy["loud"]["error_four_bit"]


def test_a_key_is_found_only_as_a_whole_number():
    assert teaching.key_found("60494", " 60494.") and teaching.key_found("60494", "It is 60494, I think")
    assert not teaching.key_found("60494", " 604949.") and not teaching.key_found("60494", " 6049.")


def test_precompute_runs_end_to_end_on_the_default_model(default_model, tmp_path):
    """The command's code path at the smallest settings: the same schema as the shipped file, JSON-serialisable."""
    model, tokenizer = default_model
    result = teaching.precompute(model, tokenizer, text_tokens=teaching.MIN_TEXT_TOKENS,
                                 lengths=(teaching.MIN_TEXT_TOKENS + 64,), depths=(0.5,), seeds=(0,),
                                 suite_methods=("kitty",), passkey_methods=("fp16", "kivi-k2v2"))
    shipped = teaching.load_precomputed()
    assert set(result) == set(shipped) and set(result["passkey"]) == set(shipped["passkey"])
    assert set(result["anatomy"]) == set(shipped["anatomy"])
    assert [row[0] for row in result["suite"]["rows"]] == ["fp16", "kitty"]
    (tmp_path / "out.json").write_text(json.dumps(result))


@pytest.mark.parametrize("method,bound", [("fp16", None), ("kitty", 0.30), ("kivi-k2v2", 0.30)])
def test_kv_ratio_on_the_default_model_at_1200_tokens(default_model, method, bound):
    """What the page shows as 'x FP16': exactly FP16 for the fp16 preset, under 0.30 for 2-bit caches at ~1,200
    tokens; and the same bytes as backend.memory's projection arithmetic."""
    model, tokenizer = default_model
    ids = tokenizer(bundled_text(), return_tensors="pt")["input_ids"][:, :1200]
    cache = make_cache(model, method)
    with torch.no_grad():
        model(ids[:, :1195], past_key_values=cache, use_cache=True)
        for i in range(1195, 1200):                               # a few decode steps: the pages' schedule
            model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
    stats = cache.stats()
    assert stats.tokens == [1200]
    assert stats.bytes_used == memory.sequence_bytes(method_config(method), model.config, 1200)
    if bound is None:
        assert stats.kv_ratio == 1.0
    else:
        assert stats.kv_ratio <= bound, stats.kv_ratio
