"""Static profile of the decode-attention kernel without a GPU: compile it for a CUDA target and count its SASS.

    TRITON_INTERPRET=0 python -m kernels.sass_profile [--method kitty-pro ...] [--dtype bf16] [--group 4] [--arch 90]
                                                      [--kernel triton|gluon|rest] [--warps N] [--maxnreg N]
                                                      [--rest-blocks N] [--rest-keys K] [--opcodes] [--blocks]
                                                      [--listing]

Prints registers per thread, spill stack, shared memory and the kernel's instructions by class, for the whole
kernel and for the body of its loop over paged blocks ("loop ...": what one page costs a warp) (matrix,
shared / local / global memory, barriers, integer, int-float conversions, float), read with the nvdisasm and
cuobjdump that ship with Triton. These are counts, not times: they show register spills, shared-memory round
trips, quarter-rate conversions and whether loads were software-pipelined (cp.async) before a GPU is at hand.
Pointers are compiled as 16-byte aligned, as Triton's JIT specializes them for fresh torch tensors.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

CLASSES = {
    "matrix": ("HMMA", "HGMMA", "IMMA"), "shared ld/st": ("LDS", "STS", "LDSM"), "local ld/st": ("LDL", "STL"),
    "global ld/st": ("LDG", "STG"), "cp.async": ("LDGSTS",), "barrier": ("BAR",),
    "integer": ("SHF", "LOP3", "IMAD", "IADD3", "PRMT", "SEL", "ISETP"),
    "int-float cvt": ("I2F", "F2F", "I2FP", "F2FP", "F2I"),
    "float": ("FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "FSETP", "FSEL"),
}
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                torch.int32: "i32", torch.int64: "i64"}


def example_paged_kv(method: str, heads: int, head_dim: int, dtype: torch.dtype):
    """A one-sequence cache of the method's layout (contents do not matter for compiling)."""
    from backend.methods import method_config
    from kernels.layout import SCALE_DTYPE, PagedKV, key_plane_shape, value_plane_shape
    cfg = method_config(method)
    s, g, h, d = cfg.sink, cfg.page_size, heads, head_dim
    nb = cfg.boosted_channels(d)
    u8 = lambda *shape: torch.zeros(shape, dtype=torch.uint8)  # noqa: E731
    f16 = lambda *shape: torch.zeros(shape, dtype=SCALE_DTYPE)  # noqa: E731
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32)  # noqa: E731
    return PagedKV(torch.zeros(1, h, s + g, d, dtype=dtype), torch.zeros(1, h, s + 2 * g, d, dtype=dtype),
                   u8(1, *key_plane_shape(h, g, d)), u8(1, *key_plane_shape(h, g, nb)), u8(1, h, nb), f16(1, h, d),
                   f16(1, h, d), u8(1, *value_plane_shape(h, d, g)),
                   u8(1, *value_plane_shape(h, d, g, cfg.v_bits == 4)), f16(1, h, g), f16(1, h, g),
                   i32(1, 1), i32(1, 1), i32(1), i32(1), i32(1), s, g, nb, cfg.v_bits)


def compile_split_kernel(method: str, dtype: torch.dtype, group: int, heads: int = 8, head_dim: int = 128,
                         splits: int = 16, arch: int = 90, num_warps: int = 1, num_stages: int = 3,
                         maxnreg: int | None = None, pdl: bool = False):
    from triton.compiler import ASTSource

    from kernels.decode_attention import MAXNREG, _decode_split_kernel, split_kernel_arguments
    from kernels.decode_rest import rest_parts
    maxnreg = maxnreg or MAXNREG
    kv = example_paged_kv(method, heads, head_dim, dtype)
    q = torch.zeros(1, heads * group, head_dim, dtype=dtype)
    n = splits + rest_parts(kv)
    parts = (torch.zeros(1, heads * group, n, head_dim), torch.zeros(1, heads * group, n),
             torch.zeros(1, heads * group, n))
    args, constants = split_kernel_arguments(q, kv, head_dim ** -0.5, parts, splits)
    return _compile(ASTSource, _decode_split_kernel, args, {**constants, "PDL": pdl}, arch,
                    {"num_warps": num_warps, "num_stages": num_stages,
                     **({"maxnreg": maxnreg} if maxnreg < 255 else {})})


def compile_rest_kernel(method: str, dtype: torch.dtype, group: int, heads: int = 8, head_dim: int = 128,
                        arch: int = 90, num_warps: int = 2, pdl: bool = False, blocks_per_program: int = 1,
                        times: bool = False, maxnreg: int | None = None, keys: str = "elements"):
    """The remaining blocks' kernel (kernels/decode_rest.py) for the same example cache as compile_split_kernel, its
    programs taking blocks_per_program blocks each (times: writing each program's start, end and multiprocessor,
    bench tune --vary timeline; maxnreg: launch_rest's register cap, None or 255 the compiler's choice; keys: how
    its key pages' blocks read their codes, decode_attention's rest_keys)."""
    from triton.compiler import ASTSource

    from kernels.decode_attention import dot_dtype, precision
    from kernels.decode_rest import TIMES_ROW, _rest_kernel, rest_kernel_arguments, rest_parts
    kv = example_paged_kv(method, heads, head_dim, dtype)
    q = torch.zeros(1, heads * group, head_dim, dtype=dtype)
    n = rest_parts(kv, blocks_per_program)
    parts = (torch.zeros(1, heads * group, n, head_dim), torch.zeros(1, heads * group, n),
             torch.zeros(1, heads * group, n))
    args, constants = rest_kernel_arguments(q, kv, 1.0, parts, 0, dot_dtype(dtype), precision(dot_dtype(dtype)),
                                            pdl, blocks_per_program, keys)
    return _compile(ASTSource, _rest_kernel, args, {**constants, **({} if times else {"times_ptr": None})}, arch,
                    {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg and maxnreg < 255 else {})},
                    {"times_ptr": torch.zeros(TIMES_ROW.value, dtype=torch.int64)} if times else None)


def compile_gluon_kernel(method: str, dtype: torch.dtype, group: int, heads: int = 8, head_dim: int = 128,
                         splits: int = 16, arch: int = 90, maxnreg: int = 255, use_tma: bool = False,
                         pdl: bool = False, i8: int = 0, compute: bool = True, copies: bool = True,
                         times: bool = False, waits: bool = False, pad: tuple[str, int] | None = None,
                         **experiments: bool):
    """The Gluon kernel of decode_attention(kernel="gluon"), or with use_tma that of kernel="gluon-tma", for the same
    example cache as compile_split_kernel (compute=False: its copies alone, copies=False: its arithmetic alone;
    bench tune --vary loads; times: writing each program's start, end and multiprocessor, --vary timeline, with
    waits also its waits for pages; pad: (kind, instructions a page) more, --vary pad; experiments: the flags of
    decode_gluon.kernel_options, zq_ahead=True ...)."""
    kv = example_paged_kv(method, heads, head_dim, dtype)
    q = torch.zeros(1, heads * group, head_dim, dtype=dtype)
    return compile_gluon_launch(q, kv, splits, arch, maxnreg, use_tma, pdl, i8, compute, copies, times, waits, pad,
                                **experiments)


def compile_gluon_launch(q: torch.Tensor, kv, splits: int = 16, arch: int = 90, maxnreg: int = 255,
                         use_tma: bool = False, pdl: bool = False, i8: int = 0, compute: bool = True,
                         copies: bool = True, times: bool = False, waits: bool = False,
                         pad: tuple[str, int] | None = None, **experiments: bool):
    """compile_gluon_kernel for queries q (B, HQ, D) over the cache kv (CPU tensors of any launch's shapes)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.decode_gluon import _gluon_paged_kernel, kernel_arguments
    from kernels.decode_rest import TIMES_ROW
    b, hq, head_dim = q.shape
    parts = (torch.zeros(b, hq, splits, head_dim), torch.zeros(b, hq, splits), torch.zeros(b, hq, splits))
    args, constants = kernel_arguments(q, kv, 1.0, parts, splits, use_tma, i8=i8, **experiments)
    return _compile(GluonASTSource, _gluon_paged_kernel, args,
                    {**constants, "PDL": pdl, "COMPUTE": compute, "COPIES": copies,
                     **({} if times else {"times_ptr": None}), "WAITS": waits, "PAD": pad[0] if pad else "",
                     "PAD_N": pad[1] if pad else 0}, arch,
                    {"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg < 255 else {})},
                    {**({"times_ptr": torch.zeros(TIMES_ROW.value, dtype=torch.int64)} if times else {}),
                     "pad_zero": 0})


def compile_merge_kernel(rows: int = 32, head_dim: int = 128, parts: int = 41, arch: int = 90, pdl: bool = False):
    """decode_attention's merge of `parts` partials a row (kernels/decode_attention.py), with its tiles for `rows`
    rows on 132 multiprocessors."""
    from triton.compiler import ASTSource

    from kernels.decode_attention import MERGE_WARPS, _merge_splits_kernel, merge_blocks
    block_s, block_dc = merge_blocks(rows, head_dim, 132, parts)
    args = (torch.zeros(rows, parts, head_dim), torch.zeros(rows, parts), torch.zeros(rows, parts),
            torch.zeros(rows, head_dim, dtype=torch.bfloat16), parts)
    constants = dict(D=head_dim, BLOCK_S=block_s, BLOCK_DC=block_dc, PDL=pdl)
    return _compile(ASTSource, _merge_splits_kernel, args, constants, arch, {"num_warps": MERGE_WARPS})


def _compile(source_class, fn, args, constants, arch, options, named: dict | None = None):
    """triton.compile for a CUDA target without a GPU: tensors become 16-byte aligned pointers of their dtype,
    tensor descriptors the type Triton's launcher would give them (args: the first parameters in order, named: later
    ones by name)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    signature, attrs = {}, {}
    for name, value in [*zip(fn.arg_names, args), *(named or {}).items()]:
        i = fn.arg_names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, TensorDescriptor):
            signature[name] = mangle_type(value)
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    # every compile-time constant, the defaults too: Triton's cache key joins their values without their names, so
    # that {A: True} and {B: True} (A, B defaulting to False) would share a key, and a profile would read the kernel
    # compiled first
    constants = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constants}
    signature.update({name: "constexpr" for name in constants})
    source = source_class(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def profile(compiled) -> dict:
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    opcodes = _opcodes(sass.splitlines())
    row = {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
           "stack bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
           "shared bytes": compiled.metadata.shared, "instructions": sum(opcodes.values())}
    row.update({name: sum(opcodes[op] for op in ops) for name, ops in CLASSES.items()})
    # the paged kernels' first loop is the one over paged slots: its body is what one page costs a warp (the rest
    # kernel's, with --rest-blocks > 1, is its loop over blocks; with one block it has none)
    loop = _opcodes((_loop_bodies(sass.splitlines()) or [[]])[0])
    row["loop instructions"] = sum(loop.values())
    row.update({f"loop {name}": sum(loop[op] for op in ops) for name, ops in CLASSES.items()})
    row["loop integer matrix"] = loop["IMMA"]          # of "loop matrix": the 8-bit products (gluon-tma-i8k / i8)
    row["loop opcodes"] = dict(loop.most_common())       # every opcode of a page, the most frequent first
    body = (_loop_bodies(sass.splitlines()) or [[]])[0]
    row["loop blocks"] = _basic_blocks(body)
    row["loop listing"] = [_instruction_text(line) for line in body if INSTRUCTION.match(line)]
    return row


def _basic_blocks(lines: list[str]) -> list[tuple[str, int, str]]:
    """A loop body's basic blocks, in order: (the address of its first instruction, its instructions, where its
    branches go: addresses, "?" before one that a predicate guards). A block ends at a branch or before a label;
    what one pass takes along a path is the sum of the blocks it runs (a branch taken skips to its target)."""
    addresses, pending = {}, []
    for line in lines:                                  # each label's address: its next instruction's
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
        elif INSTRUCTION.match(line):
            for label in pending:
                addresses[label] = _address(line)
            pending = []
    blocks, start, count, jumps = [], "", 0, []
    for line in lines:
        if re.match(r"\s*\.L_x_\d+:", line) and count:
            blocks.append((start, count, " ".join(jumps)))
            start, count, jumps = "", 0, []
        elif INSTRUCTION.match(line):
            start, count = start or _address(line), count + 1
            target = re.search(r"(@!?U?P\w+\s+)?BRA.*`\(\.(L_x_\d+)\)", line)
            if target:
                jumps.append(("?" if target.group(1) else "") + addresses.get(target.group(2), target.group(2)))
                blocks.append((start, count, " ".join(jumps)))
                start, count, jumps = "", 0, []
    if count:
        blocks.append((start, count, " ".join(jumps)))
    return blocks


def _instruction_text(line: str) -> str:
    """An nvdisasm line with its runs of spaces made one: `/*39f0*/ HMMA.16816.F32 R60, R60, R76, RZ ;`."""
    return " ".join(line.split())


def _address(line: str) -> str:
    return "0x" + re.match(r"\s*/\*([0-9a-f]+)\*/", line).group(1)


INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _opcodes(lines: list[str]) -> collections.Counter:
    return collections.Counter(m.group(1) for m in map(INSTRUCTION.match, lines) if m)


def _loop_bodies(lines: list[str]) -> list[list[str]]:
    """The SASS lines from each label to a later branch back to it (nvdisasm's `.L_x_N:` labels), in the order
    their branches appear."""
    labels = {m.group(1): i for i, m in enumerate(re.match(r"\s*\.L_x_(\d+):", line) for line in lines) if m}
    bodies = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA.*`\(\.L_x_(\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            bodies.append(lines[labels[target.group(1)]:i + 1])
    return bodies


def _kernel_name(kernel: str) -> str:
    """--kernel's type: "rest", or a kernel decode_attention takes other than "auto" (argparse reports the
    ValueError)."""
    from kernels.decode_attention import kernel_parts
    if kernel == "auto":
        raise ValueError(kernel)
    if kernel != "rest":
        kernel_parts(kernel)
    return kernel


def main(argv=None) -> int:
    from kernels.decode_attention import is_gluon
    from kernels.decode_rest import KEY_READS
    parser = argparse.ArgumentParser(prog="python -m kernels.sass_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", nargs="*", default=["kitty-pro", "kitty", "kivi-k2v2"])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (Qwen3-8B: 4)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (Hopper: 90)")
    parser.add_argument("--warps", type=int, default=1,
                        help="warps per program (the Triton kernel's num_warps, or the rest kernel's rest_warps; the "
                             "Gluon kernel's programs are one warp)")
    parser.add_argument("--stages", type=int, default=3, help="software-pipelining depth (Triton's num_stages)")
    parser.add_argument("--kernel", default="triton", type=_kernel_name,
                        help="decode_attention's kernel over the paged blocks (triton, or gluon*: "
                             "kernels/decode_gluon.py, with experiments as decode_attention takes them, "
                             "gluon-tma+zq-ahead ...), or the one over the remaining blocks (rest: "
                             "kernels/decode_rest.py, with a loop over blocks only where --rest-blocks > 1)")
    parser.add_argument("--rest-blocks", type=int, default=1,
                        help="the rest kernel's blocks a program (decode_rest.rest_blocks_per_program: 1 compiles "
                             "without the loop over blocks)")
    parser.add_argument("--rest-keys", default="elements", choices=KEY_READS,
                        help="how the rest kernel's key pages' blocks read their codes (decode_attention's rest_keys, "
                             "decode_rest.KEY_READS)")
    parser.add_argument("--opcodes", action="store_true",
                        help="also print the page loop's count of every opcode (which pipe a page fills: LOP3 / SHF / "
                             "PRMT on the integer pipe, HMMA on the matrix unit, FFMA / HMUL2 on the multiply-add "
                             "pipe; bench tune --vary pad measures what one more of some of them costs)")
    parser.add_argument("--blocks", action="store_true",
                        help="also print the loop's basic blocks with their instructions and branch targets (which "
                             "kind of block or page takes which path: the rest kernel's key pages, 16-bit rows and "
                             "value pages are branches of one loop)")
    parser.add_argument("--listing", action="store_true",
                        help="also print the loop's SASS, an instruction a line (where a product's operands come "
                             "from: the moves and constants that fill its register quads)")
    parser.add_argument("--maxnreg", type=int,
                        help="register cap per thread (default: decode_attention's MAXNREG for the Triton kernel, "
                             "the compiler's choice for the Gluon and rest kernels; 255: the compiler's choice)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run with TRITON_INTERPRET=0: without a GPU, importing kernels/ turns Triton's interpreter on, "
              "and an interpreted kernel cannot be compiled", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    for method in args.method:
        if args.kernel != "rest" and is_gluon(args.kernel):
            from backend.methods import method_config
            from kernels.decode_gluon import kernel_options
            options = kernel_options(args.kernel)
            if options["i8"] and method_config(method).boosted_channels(128) not in (0, 32):
                print(f"{method:>10}: {args.kernel} declines its boosted channels (decode_gluon.supports_kernel)")
                continue
            compiled = compile_gluon_kernel(method, dtype, args.group, arch=args.arch, maxnreg=args.maxnreg or 255,
                                            **options)
        elif args.kernel == "rest":
            compiled = compile_rest_kernel(method, dtype, args.group, arch=args.arch, num_warps=args.warps,
                                           blocks_per_program=args.rest_blocks, maxnreg=args.maxnreg,
                                           keys=args.rest_keys)
        else:
            compiled = compile_split_kernel(method, dtype, args.group, arch=args.arch, num_warps=args.warps,
                                            num_stages=args.stages, maxnreg=args.maxnreg)
        row = profile(compiled)
        opcodes, blocks, listing = row.pop("loop opcodes"), row.pop("loop blocks"), row.pop("loop listing")
        print(f"{method:>10}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        if args.opcodes:
            print(f"{'':>10}  loop opcodes: " + ", ".join(f"{op} {n}" for op, n in opcodes.items()), flush=True)
        if args.blocks:
            print(f"{'':>10}  loop blocks: " + ", ".join(f"{start} {n}" + (f" -> {jumps}" if jumps else "")
                                                        for start, n, jumps in blocks), flush=True)
        if args.listing:
            print("\n".join(f"{'':>12}{line}" for line in listing), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
