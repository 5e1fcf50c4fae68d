"""Dequantization of whole pages (the paper's Algorithm 1 for keys; per-token for values).

The decode-attention kernel never calls these: it dequantizes in registers. They serve the paths that need
full-precision pages: continuing a prompt on a filled cache (chunked prefill), analysis, and tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import unpack_2bit


# ---------------------------------------------------------------------------------------------- references
def key_codes_ref(low: torch.Tensor, high: torch.Tensor, idx: torch.Tensor, n_boost: int) -> torch.Tensor:
    """(N, H, D, G) integer codes of key pages: low | high << 2, high taken from row idx of boosted channels."""
    code = unpack_2bit(low)
    if n_boost:
        boosted = idx.long() < n_boost
        rows = torch.where(boosted, idx.long(), 0)
        hi = unpack_2bit(high)                                                  # (N, H, NB, G)
        hi = hi.gather(2, rows.unsqueeze(-1).expand(-1, -1, -1, hi.shape[-1]))  # (N, H, D, G)
        code = code | torch.where(boosted.unsqueeze(-1), hi, 0) << 2
    return code


def dequantize_keys_ref(low, high, idx, scale, zero, n_boost: int, dtype=torch.float16) -> torch.Tensor:
    """Key pages -> (N, H, G, D) in `dtype`."""
    code = key_codes_ref(low, high, idx, n_boost).float()
    k = code * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return k.transpose(2, 3).to(dtype)


def dequantize_values_ref(low, high, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Value pages -> (N, H, G, D) in `dtype`; `high` has 0 rows for 2-bit values."""
    code = unpack_2bit(low)
    if high.shape[2]:
        code = code | unpack_2bit(high) << 2
    v = code.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return v.to(dtype)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _dequantize_keys_kernel(low_ptr, high_ptr, idx_ptr, scale_ptr, zero_ptr, out_ptr,
                            G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_G4)
    i = tl.arange(0, 4)
    dmask = d < D
    bmask = dmask[:, None] & (j < G // 4)[None, :]
    shifts = (i * 2)[None, None, :]
    # Algorithm 1: scale, zero and boost index per channel; low bits of every channel; high bits of boosted ones
    scale = tl.load(scale_ptr + pid * D + d, mask=dmask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + pid * D + d, mask=dmask, other=0.0).to(tl.float32)
    low = tl.load(low_ptr + pid * D * (G // 4) + d[:, None] * (G // 4) + j[None, :], mask=bmask, other=0)
    code = (low[:, :, None].to(tl.int32) >> shifts) & 3
    if NB > 0:
        idx = tl.load(idx_ptr + pid * D + d, mask=dmask, other=255).to(tl.int32)
        boosted = idx < NB
        high = tl.load(high_ptr + pid * NB * (G // 4) + tl.where(boosted, idx, 0)[:, None] * (G // 4) + j[None, :],
                       mask=bmask & boosted[:, None], other=0)
        code = code | (((high[:, :, None].to(tl.int32) >> shifts) & 3) << 2)
    k = code.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
    t = j[:, None] * 4 + i[None, :]
    mask = dmask[:, None, None] & (t < G)[None, :, :]
    tl.store(out_ptr + pid * G * D + t[None, :, :] * D + d[:, None, None], k.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_values_kernel(low_ptr, high_ptr, scale_ptr, zero_ptr, out_ptr,
                              G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_D4: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D4)
    i = tl.arange(0, 4)
    tmask = t < G
    bmask = tmask[:, None] & (c < D // 4)[None, :]
    shifts = (i * 2)[None, None, :]
    offs = pid * G * (D // 4) + t[:, None] * (D // 4) + c[None, :]
    code = (tl.load(low_ptr + offs, mask=bmask, other=0)[:, :, None].to(tl.int32) >> shifts) & 3
    if BITS == 4:
        code = code | (((tl.load(high_ptr + offs, mask=bmask, other=0)[:, :, None].to(tl.int32) >> shifts) & 3) << 2)
    scale = tl.load(scale_ptr + pid * G + t, mask=tmask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + pid * G + t, mask=tmask, other=0.0).to(tl.float32)
    v = code.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
    ch = c[:, None] * 4 + i[None, :]
    mask = tmask[:, None, None] & (ch < D)[None, :, :]
    tl.store(out_ptr + pid * G * D + t[:, None, None] * D + ch[None, :, :], v.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_keys(low, high, idx, scale, zero, n_boost: int, dtype=torch.float16) -> torch.Tensor:
    """Triton launch of dequantize_keys_ref."""
    n, h, d, g4 = low.shape
    out = torch.empty((n, h, 4 * g4, d), dtype=dtype, device=low.device)
    if n * h:
        _dequantize_keys_kernel[(n * h,)](low, high, idx, scale, zero, out, G=4 * g4, D=d, NB=n_boost,
                                          BLOCK_D=triton.next_power_of_2(d),
                                          BLOCK_G4=triton.next_power_of_2(g4), num_warps=4)
    return out


def dequantize_values(low, high, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Triton launch of dequantize_values_ref."""
    n, h, g, d4 = low.shape
    out = torch.empty((n, h, g, 4 * d4), dtype=dtype, device=low.device)
    if n * h:
        _dequantize_values_kernel[(n * h,)](low, high, scale, zero, out, G=g, D=4 * d4,
                                            BITS=4 if high.shape[2] else 2, BLOCK_G=triton.next_power_of_2(g),
                                            BLOCK_D4=triton.next_power_of_2(d4), num_warps=4)
    return out
