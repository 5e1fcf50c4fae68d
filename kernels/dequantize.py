"""Dequantization of whole pages (the paper's Algorithm 1 for keys; per-token for values).

The decode-attention kernel never calls these: it dequantizes in registers. They serve the paths that need
full-precision pages: a further prompt chunk on a filled cache (batched on a GPU), analysis, and tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import unpack_quarters


# ---------------------------------------------------------------------------------------------- references
def key_codes_ref(low: torch.Tensor, high: torch.Tensor, ch: torch.Tensor) -> torch.Tensor:
    """(N, H, G, D) integer codes of key pages: low | high << 2, high only in the boosted channels ch."""
    code = unpack_quarters(low, dim=2)
    if ch.shape[-1]:
        cols = ch.long().unsqueeze(2).expand(-1, -1, code.shape[2], -1)         # (N, H, G, NB)
        code = code.scatter(3, cols, code.gather(3, cols) | unpack_quarters(high, dim=2) << 2)
    return code


def dequantize_keys_ref(low, high, ch, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Key pages -> (N, H, G, D) in `dtype`."""
    code = key_codes_ref(low, high, ch).float()
    return (code * scale.float().unsqueeze(2) + zero.float().unsqueeze(2)).to(dtype)


def dequantize_values_ref(low, high, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Value pages (N, H, D/4, G) planes -> (N, H, G, D) in `dtype`; `high` has 0 rows for 2-bit values."""
    code = unpack_quarters(low, dim=2)                                          # (N, H, D, G)
    if high.shape[2]:
        code = code | unpack_quarters(high, dim=2) << 2
    v = code.transpose(2, 3).float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return v.to(dtype)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _dequantize_keys_kernel(low_ptr, high_ptr, ch_ptr, scale_ptr, zero_ptr, out_ptr,
                            G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_NB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    boosted = d < 0
    if NB > 0:
        r = tl.arange(0, BLOCK_NB)
        ch = tl.load(ch_ptr + pid * NB + r, mask=r < NB, other=BLOCK_D).to(tl.int32)
        boosted = tl.max((ch[None, :] == d[:, None]).to(tl.int32), axis=1) > 0
    mask = (j < G4)[:, None] & dmask[None, :]
    scale = tl.load(scale_ptr + pid * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    zero = tl.load(zero_ptr + pid * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    low = tl.load(low_ptr + pid * G4 * D + j[:, None] * D + d[None, :], mask=mask, other=0).to(tl.int32)
    out = out_ptr + pid * G * D + j[:, None] * D + d[None, :]                  # + i*G4*D: token quarter i
    keep = mask & ~boosted[None, :]                                            # boosted columns: written below
    for i in tl.static_range(4):
        k = ((low >> (2 * i)) & 3).to(tl.float32) * scale + zero
        tl.store(out + i * G4 * D, k.to(out_ptr.dtype.element_ty), mask=keep)
    if NB > 0:
        hmask = (j < G4)[:, None] & (r < NB)[None, :]
        cols = j[:, None] * D + ch[None, :]
        lo = tl.load(low_ptr + pid * G4 * D + cols, mask=hmask, other=0).to(tl.int32)
        hi = tl.load(high_ptr + pid * G4 * NB + j[:, None] * NB + r[None, :], mask=hmask, other=0).to(tl.int32)
        s = tl.load(scale_ptr + pid * D + ch, mask=r < NB, other=0.0).to(tl.float32)[None, :]
        z = tl.load(zero_ptr + pid * D + ch, mask=r < NB, other=0.0).to(tl.float32)[None, :]
        for i in tl.static_range(4):
            code = ((lo >> (2 * i)) & 3) | (((hi >> (2 * i)) & 3) << 2)
            tl.store(out_ptr + pid * G * D + i * G4 * D + cols, (code.to(tl.float32) * s + z).to(out_ptr.dtype.element_ty),
                     mask=hmask)


@triton.jit
def _dequantize_values_kernel(low_ptr, high_ptr, scale_ptr, zero_ptr, out_ptr,
                              G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_D4: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    D4: tl.constexpr = D // 4
    t = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D4)
    tmask = t < G
    mask = tmask[:, None] & (c < D4)[None, :]
    offs = pid * D4 * G + c[None, :] * G + t[:, None]
    low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int32)
    if BITS == 4:
        high = tl.load(high_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + pid * G + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(zero_ptr + pid * G + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pid * G * D + t[:, None] * D + c[None, :]                  # + i*D4: channel quarter i
    for i in tl.static_range(4):
        code = (low >> (2 * i)) & 3
        if BITS == 4:
            code = code | (((high >> (2 * i)) & 3) << 2)
        tl.store(out + i * D4, (code.to(tl.float32) * scale + zero).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_keys(low, high, ch, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Triton launch of dequantize_keys_ref."""
    n, h, g4, d = low.shape
    nb = ch.shape[-1]
    out = torch.empty((n, h, 4 * g4, d), dtype=dtype, device=low.device)
    if n * h:
        _dequantize_keys_kernel[(n * h,)](low, high, ch, scale, zero, out, G=4 * g4, D=d, NB=nb,
                                          BLOCK_D=triton.next_power_of_2(d), BLOCK_G4=triton.next_power_of_2(g4),
                                          BLOCK_NB=triton.next_power_of_2(max(nb, 1)), num_warps=4)
    return out


def dequantize_values(low, high, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Triton launch of dequantize_values_ref."""
    n, h, d4, g = low.shape
    out = torch.empty((n, h, g, 4 * d4), dtype=dtype, device=low.device)
    if n * h:
        _dequantize_values_kernel[(n * h,)](low, high, scale, zero, out, G=g, D=4 * d4,
                                            BITS=4 if high.shape[2] else 2, BLOCK_G=triton.next_power_of_2(g),
                                            BLOCK_D4=triton.next_power_of_2(d4), num_warps=4)
    return out
