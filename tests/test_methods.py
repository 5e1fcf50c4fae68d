"""The methods registry: presets as the paper defines them, custom settings, and a clear error for each
invalid setting (naming it)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from backend import METHODS, PRESETS, CacheConfig, method_config


def test_presets_match_the_paper():
    assert METHODS == ("fp16", "kivi-k2v2", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*", "kivi-k4v4", "kitty",
                       "kitty-pro", "kitty-q", "kitty-pro-q")
    assert PRESETS["kitty"].alpha == 0.125 and PRESETS["kitty-pro"].alpha == 0.25
    for name in ("kitty", "kitty-pro", "kivi-k2v2*", "kivi-k2v4*", "kivi-k4v2*"):
        cfg = PRESETS[name]
        assert (cfg.sink, cfg.page_size, cfg.local_window) == (32, 128, 128), name
    assert PRESETS["kivi-k2v2"].sink == 0 and PRESETS["kivi-k2v2"].alpha == 0
    assert (PRESETS["kivi-k2v4*"].k_bits, PRESETS["kivi-k2v4*"].v_bits) == (2, 4)
    assert (PRESETS["kivi-k4v2*"].k_bits, PRESETS["kivi-k4v2*"].v_bits) == (4, 2)
    assert PRESETS["fp16"].is_full_precision and not PRESETS["kitty"].is_full_precision
    # beyond the paper: the same budgets with query-aware channels (BENCHMARKS.md section 6)
    for plain in ("kitty", "kitty-pro"):
        assert PRESETS[f"{plain}-q"] == replace(PRESETS[plain], name=f"{plain}-q", selection="query")


def test_boosted_channel_counts():
    assert PRESETS["kitty"].boosted_channels(128) == 16 and PRESETS["kitty-pro"].boosted_channels(128) == 32
    assert PRESETS["kitty"].boosted_channels(64) == 8
    assert method_config(alpha=0.2).boosted_channels(64) == 13             # ceil(0.2 * 64)
    assert PRESETS["kivi-k4v4"].boosted_channels(64) == 64                  # 4-bit keys: every channel has high bits
    assert PRESETS["kivi-k2v2"].boosted_channels(64) == 0 and PRESETS["fp16"].boosted_channels(64) == 0


def test_custom_and_overrides():
    cfg = method_config("kitty", alpha=0.2, sink=16, page_size=64, local_window=64, selection="random")
    assert (cfg.alpha, cfg.sink, cfg.page_size, cfg.local_window, cfg.selection) == (0.2, 16, 64, 64, "random")
    assert cfg.name == "kitty (custom)" and cfg.k_bits == 2
    assert method_config("custom", k_bits=4, v_bits=16).name == "custom"
    assert method_config("kitty") is PRESETS["kitty"]


@pytest.mark.parametrize("settings,named", [
    (dict(alpha=1.5), "alpha"), (dict(alpha=-0.1), "alpha"), (dict(alpha="a lot"), "alpha"),
    (dict(k_bits=3), "k_bits"), (dict(k_bits=8), "k_bits"), (dict(v_bits=1), "v_bits"), (dict(v_bits=True), "v_bits"),
    (dict(page_size=130), "page_size"), (dict(page_size=0), "page_size"), (dict(page_size=2048), "page_size"),
    (dict(sink=-1), "sink"), (dict(local_window=-5), "local_window"), (dict(sink=2.5), "sink"),
    (dict(selection="entropy"), "selection"), (dict(k_bits=4, alpha=0.125), "alpha"),
])
def test_invalid_settings_raise_value_error_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        method_config("custom", **settings)


def test_unknown_preset_and_unknown_setting():
    with pytest.raises(ValueError, match="unknown method 'kitty-max'"):
        method_config("kitty-max")
    with pytest.raises(ValueError, match="unknown cache setting.*group_size"):
        method_config("kitty", group_size=64)


def test_config_is_immutable_and_serialisable():
    cfg = CacheConfig(k_bits=2, alpha=0.125)
    with pytest.raises(Exception):
        cfg.alpha = 0.5
    assert cfg.as_dict()["alpha"] == 0.125
