"""2-bit codes -> 16-bit matrix operands with bit operations: the inline PTX of the Triton kernels' unpacking
(decode_attention's _quarters, decode_rest's _field), and where it applies.

Each string is a function of one 32-bit word of 4 code bytes, as Triton's inline_asm_elementwise hands it 4 uint8
elements (pack=4); tests/test_kernels.py executes the strings instruction by instruction on the CPU.
"""
from __future__ import annotations

import os

import torch
import triton.language as tl

# 2-bit fields -> 16-bit operands with bit operations (the lop3 trick of Marlin / BitDecoding). A 32-bit word holds
# four bytes b0..b3 (4 consecutive elements of the contracted dimension); prmt reorders them (b0, b2, b1, b3) so
# that the low byte of each 16-bit half is b0 / b1, or b2 / b3 after >> 8. OR-ing the field at bits 2i into the
# mantissa of a "magic" float M (bf16 128, fp16 1024: spacing 1 there) gives M + w * code with w = 4^i; one fused
# multiply-add per pair, (M + w * code) / w - M / w, returns the code exactly. bf16 has 7 mantissa bits, so its
# fourth field (bits 6-7) is shifted down first (w = 1). With offset=True (the kernel's bf16 path) the fma is left
# out and the operand stays M + w * code; the kernel takes M and w out of the products' fp32 sums instead, one
# multiply-add per score or output element instead of one per pair of code elements. Not for fp16: its M = 1024
# leaves 8x fewer bits after the offset cancels, measured past the tests' tolerance (BENCHMARKS.md).
MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}
FIELDS_IN_MANTISSA = {torch.bfloat16: 3, torch.float16: 4}
FMA = {torch.bfloat16: "fma.rn.bf16x2", torch.float16: "fma.rn.f16x2"}


def _bits16(value: float, dtype: torch.dtype) -> int:
    """A 32-bit word holding `value` in both 16-bit halves."""
    half = torch.tensor([value], dtype=dtype).view(torch.int16).item() & 0xFFFF
    return half | half << 16


def field_weights(dtype: torch.dtype) -> list[float]:
    """w of each quarter's operand M + w * code in unpack_asm(dtype, offset=True)."""
    return [4.0 ** (i if i < FIELDS_IN_MANTISSA[dtype] else 0) for i in range(4)]


def unpack_asm(dtype: torch.dtype, offset: bool = False) -> str:
    """PTX: one word of 4 bytes ($8) -> for each quarter i, the 16-bit pairs of field i of bytes (0, 1) in $2i and
    of bytes (2, 3) in $2i+1, as exact values 0..3 of `dtype` (offset=True: as M + w_i * code, field_weights)."""
    magic = MAGIC[dtype]
    lines = ["{ .reg .b32 t, u, v, s, o;", "prmt.b32 t, $8, 0, 0x3120;", "shr.b32 u, t, 8;"]
    for i, weight in enumerate(field_weights(dtype)):
        shift = 2 * i                                 # where field i sits; fields past the mantissa move down
        if i >= FIELDS_IN_MANTISSA[dtype]:
            lines += [f"shr.b32 t, t, {shift};", f"shr.b32 u, u, {shift};"]
            shift = 0
        if not offset:
            lines += [f"mov.b32 s, {_bits16(1.0 / weight, dtype):#x};",
                      f"mov.b32 o, {_bits16(-magic / weight, dtype):#x};"]
        for k, word in enumerate("tu"):
            mask = f"{0x00030003 << shift:#x}, {_bits16(magic, dtype):#x}, 0xea;"
            if offset:
                lines += [f"lop3.b32 ${2 * i + k}, {word}, {mask}"]
            else:
                lines += [f"lop3.b32 v, {word}, {mask}", f"{FMA[dtype]} ${2 * i + k}, v, s, o;"]
    return " ".join(lines) + " }"



def field_asm(dtype: torch.dtype) -> str:
    """PTX: a shift ($2: 2 * the field's index, 0 to 6; $3-$5 are Triton's copies of it for the word's other 3
    elements) and one word of 4 bytes ($6) -> that one field of bytes (0, 1) as a 16-bit pair in $0 and of bytes
    (2, 3) in $1, exact values 0..3 of `dtype`. The shift comes first, so that every field lands in the low bits of
    its byte: the magic number's mantissa holds it whichever field it is."""
    mask = f"0x00030003, {_bits16(MAGIC[dtype], dtype):#x}, 0xea;"
    return " ".join(["{ .reg .b32 t, u, v, s, o;", "prmt.b32 t, $6, 0, 0x3120;", "shr.b32 t, t, $2;",
                     "shr.b32 u, t, 8;", f"mov.b32 s, {_bits16(1.0, dtype):#x};",
                     f"mov.b32 o, {_bits16(-MAGIC[dtype], dtype):#x};", f"lop3.b32 v, t, {mask}",
                     f"{FMA[dtype]} $0, v, s, o;", f"lop3.b32 v, u, {mask}", f"{FMA[dtype]} $1, v, s, o; }}"])


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unpacking(dot, compiled: bool | None = None) -> int:
    """The Triton kernel's ASM for operands of type `dot`: its unpacking by inline PTX for half types (1: bfloat16,
    2: float16; _quarters, _field) where it is compiled (default: unless interpreted), else 0 (the interpreter has
    no PTX)."""
    compiled = not interpreted() if compiled is None else compiled
    return {tl.bfloat16: 1, tl.float16: 2}.get(dot, 0) if compiled else 0
