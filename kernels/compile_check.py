"""Compile every Triton kernel a cache launches for a CUDA target, without a GPU.

    python -m kernels.compile_check [--page-sizes 4 8 16] [--head-dim 64] [--methods kitty-pro ...] [--arch 90]

Why: CI has no GPU. There the kernels run in Triton's interpreter, which runs a jit function as Python, so code the
compiler rejects can pass every CPU test and fail on every GPU. It did: a reshape after a static branch that
returned (the compiler builds the statements after it too) broke all caches with pages under 16 tokens on a GPU
(layout.in_order; BENCHMARKS.md section 1, session 37).

How: a first process, in the interpreter, generates with a small random-weight model and each method's cache at each
page size (a ragged batch, its prompt in chunks, then decode steps past a page boundary) and records every launch:
the kernel, its arguments' dtypes, its compile-time constants and launch options. A second process, without the
interpreter, compiles each distinct launch for the target (kernels.sass_profile's compile) and prints a line a
kernel. Exit status 1 if any failed to compile. Gluon kernels are not covered (GPU only: their own GPU tests).
"""
from __future__ import annotations

import argparse
import inspect
import os
import pickle
import subprocess
import sys
import tempfile

import torch

OPTIONS = ("num_warps", "num_stages", "maxnreg")            # launch options that change the compiled kernel
IGNORED = ("launch_pdl", "grid", "warmup")                  # launch options that do not


def _spec(value, constexpr: bool):
    """What of an argument decides its compiled kernel: a tensor's dtype, a run-time scalar's type (as a stand-in
    value of it), else the value itself."""
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype
    if not constexpr and isinstance(value, (int, float)) and not isinstance(value, bool):
        return "value", 2 if isinstance(value, int) else 1.5
    return "value", value


def _as_on_a_gpu(named: dict) -> dict:
    """A launch's arguments as a GPU would get them: the interpreter's float32 products for bfloat16 tensors
    (dot_dtype) in bfloat16, with the products' precision and the unpacking's PTX (ASM) of compiled kernels."""
    import triton.language as tl

    from kernels.decode_attention import precision, unpacking
    if "DOT" not in named:
        return named
    dot = named["DOT"]
    if dot == tl.float32 and any(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 for v in named.values()):
        dot = tl.bfloat16
    return {**named, "DOT": dot, "PREC": precision(dot), **({"ASM": unpacking(dot, True)} if "ASM" in named else {})}


def record(out: str, page_sizes: list[int], head_dim: int, methods: list[str], dtypes: list[str]) -> None:
    """Run the generations in Triton's interpreter and write every distinct launch to `out` (pickle)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        params = inspect.signature(self.fn).parameters
        named = _as_on_a_gpu({**dict(zip(self.arg_names, args)),
                              **{k: v for k, v in kwargs.items() if k not in IGNORED}})
        launches.add((self.fn.__module__, self.fn.__name__, tuple(sorted(
            (k, _spec(v, k not in params or "constexpr" in str(params[k].annotation))) for k, v in named.items()))))
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording_run
    for page_size in page_sizes:
        for method in methods:
            for dtype in dtypes:
                _generate(method, page_size, head_dim, getattr(torch, dtype))
    with open(out, "wb") as f:
        pickle.dump(sorted(launches, key=str), f)


def _generate(method: str, page_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """A ragged batch of two prompts (one left-padded), prefilled in chunks, then decoded past a page boundary, with
    a 2-layer random-weight Llama (8 query heads on 2 KV heads) in `dtype` and the method's cache on Triton's
    kernels, pages made by the fused kernels as on a GPU."""
    import transformers

    from backend import make_cache
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=8 * head_dim, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=head_dim, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    width = 3 * page_size + 3
    ids = torch.randint(3, 64, (2, width), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :page_size + 1] = 0
    cache = make_cache(model, method, use_triton=True, flush="fused", sink=4, page_size=page_size,
                       local_window=page_size)
    with torch.no_grad():
        model.generate(ids * mask, attention_mask=mask, past_key_values=cache, max_new_tokens=page_size + 2,
                       do_sample=False, pad_token_id=0, prefill_chunk_size=page_size + 1)


def compile_all(path: str, arch: int) -> int:
    """Compile every launch recorded at `path` for sm_`arch`; print a line each; 1 if any failed."""
    import importlib

    from kernels.sass_profile import _compile
    from triton.compiler import ASTSource

    with open(path, "rb") as f:
        launches = pickle.load(f)
    failed = 0
    for module, name, args in launches:
        fn = getattr(importlib.import_module(module), name)
        params = {p.name: p for p in fn.params}
        named, constants, options = {}, {}, {}
        for k, (kind, v) in args:
            if k in OPTIONS:
                options[k] = v
            elif kind == "tensor":
                named[k] = torch.zeros(1, dtype=v)
            elif params[k].is_constexpr or v is None:
                constants[k] = v
            else:
                named[k] = v
        # parameters left to their defaults (a measurement's pointer, None) are compile-time constants then
        constants.update({p.name: p.default for p in fn.params
                          if p.name not in named and p.name not in constants and p.has_default})
        shown = ", ".join(f"{k}={v}" for k, v in sorted(constants.items()) if k.isupper())
        try:
            _compile(ASTSource, fn, (), constants, arch, options, named)
            print(f"ok    {name} ({shown})", flush=True)
        except Exception as e:                                   # the compiler's error is the finding
            failed += 1
            print(f"FAIL  {name} ({shown}): {str(e).strip().splitlines()[-1]}", flush=True)
    print(f"{len(launches)} launches, {failed} failed to compile for sm_{arch}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["kitty-pro", "kitty-q", "kivi-k2v2", "kivi-k4v4"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the model's (torch names)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (Hopper: 90)")
    parser.add_argument("--record", metavar="FILE", help=argparse.SUPPRESS)     # the first process's part
    parser.add_argument("--compile", metavar="FILE", help=argparse.SUPPRESS)    # the second's
    args = parser.parse_args(argv)
    if args.record:
        record(args.record, args.page_sizes, args.head_dim, args.methods, args.dtypes)
        return 0
    if args.compile:
        return compile_all(args.compile, args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.pickle")
        common = [sys.executable, "-m", "kernels.compile_check", "--page-sizes", *map(str, args.page_sizes),
                  "--head-dim", str(args.head_dim), "--methods", *args.methods, "--dtypes", *args.dtypes,
                  "--arch", str(args.arch)]
        subprocess.run([*common, "--record", path], env={**os.environ, "TRITON_INTERPRET": "1"}, check=True)
        return subprocess.run([*common, "--compile", path], env={**os.environ, "TRITON_INTERPRET": "0"}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
