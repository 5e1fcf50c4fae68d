"""Quantize-and-pack of full pages: keys per channel with a channel-wise precision boost, values per token.

Both sides share one rounding recipe so the Triton kernels equal their references bit for bit:
    scale = fp16((max - min) / levels), zero = fp16(min)        (divisions IEEE-rounded)
    code  = clamp(floor((x - zero) / scale + 0.5), 0, levels)   (scale 0 -> code 0: a constant channel)
with levels = 3 (2 bits) or 15 (4 bits). Inputs are (N, H, G, D): N pages of G tokens, H KV heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import NO_BOOST, SCALE_DTYPE, pack_2bit


# ---------------------------------------------------------------------------------------------- boost choice
def choose_boost(x: torch.Tensor, n_boost: int, selection: str = "magnitude",
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the boosted channels of each (page, head): the top n_boost by mean |k| over the page (Eq. 2),
    or n_boost random ones. Returns (idx (N, H, D) uint8: row in the high plane or NO_BOOST, magnitudes (N, H, D)).
    Rows follow channel order, so a page's high plane lists its boosted channels from low to high."""
    n, h, _, d = x.shape
    # L1 norm accumulated in float32, without writing float copies of the pages (as .float().abs() did)
    magnitudes = torch.linalg.vector_norm(x, ord=1, dim=2, dtype=torch.float32) / x.shape[2]
    idx = torch.full((n, h, d), NO_BOOST, dtype=torch.uint8, device=x.device)
    if n_boost == 0:
        return idx, magnitudes
    if n_boost == d:
        idx[:] = torch.arange(d, dtype=torch.uint8, device=x.device)
        return idx, magnitudes
    if selection == "magnitude":
        score = magnitudes
    else:
        score = torch.rand((n, h, d), generator=generator, device=generator.device if generator else "cpu")
        score = score.to(x.device)
    chosen = score.topk(n_boost, dim=-1).indices.sort(dim=-1).values
    rows = torch.arange(n_boost, dtype=torch.uint8, device=x.device).expand(n, h, n_boost)
    idx.scatter_(-1, chosen, rows)
    return idx, magnitudes


# ---------------------------------------------------------------------------------------------- references
def _codes(x32: torch.Tensor, dim: int, levels: torch.Tensor):
    mn = x32.amin(dim, keepdim=True)
    mx = x32.amax(dim, keepdim=True)
    scale = ((mx - mn) / levels).to(SCALE_DTYPE)
    zero = mn.to(SCALE_DTYPE)
    s, z = scale.float(), zero.float()
    code = torch.floor((x32 - z) / torch.where(s > 0, s, torch.ones_like(s)) + 0.5)
    code = torch.minimum(code.clamp_min(0), levels).to(torch.int32)
    return code, scale.squeeze(dim), zero.squeeze(dim)


def quantize_keys_ref(x: torch.Tensor, idx: torch.Tensor, n_boost: int):
    """x (N, H, G, D), idx (N, H, D) -> low (N, H, D, G/4), high (N, H, NB, G/4), scale, zero (N, H, D)."""
    n, h, g, d = x.shape
    xt = x.float().transpose(2, 3)                                   # (N, H, D, G): per-channel rows
    boosted = idx.to(torch.int32) < n_boost
    levels = torch.where(boosted, 15.0, 3.0).unsqueeze(-1)
    code, scale, zero = _codes(xt, -1, levels)
    low = pack_2bit(code & 3)
    high = torch.zeros((n, h, n_boost, g // 4), dtype=torch.uint8, device=x.device)
    if n_boost:
        rows = idx.long().clamp(max=n_boost - 1)                     # non-boosted rows are masked out below
        hi = pack_2bit(code >> 2)
        sel = boosted.nonzero(as_tuple=True)
        high[sel[0], sel[1], rows[sel]] = hi[sel]
    return low, high, scale, zero


def quantize_values_ref(x: torch.Tensor, bits: int):
    """x (N, H, G, D) -> low (N, H, G, D/4), high (N, H, G, D/4) or an empty plane for 2 bits, scale, zero (N, H, G)."""
    levels = torch.tensor(float(2 ** bits - 1), device=x.device)
    code, scale, zero = _codes(x.float(), -1, levels)
    low = pack_2bit(code & 3)
    high = pack_2bit(code >> 2) if bits == 4 else low.new_zeros((*low.shape[:2], 0, low.shape[3]))
    return low, high, scale, zero


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _params(mn, mx, levels):
    """FP16 scale and zero-point of the shared rounding recipe (see module doc)."""
    return tl.math.div_rn(mx - mn, levels).to(tl.float16), mn.to(tl.float16)


@triton.jit
def _encode(x, mask, scale, zero, levels):
    """Codes of x for FP16 scale / zero already broadcast against x; 0 where masked."""
    s = scale.to(tl.float32)
    code = tl.math.floor(tl.math.div_rn(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0)) + 0.5)
    code = tl.minimum(tl.maximum(code, 0.0), levels).to(tl.int32)
    return tl.where(mask, code, 0)


@triton.jit
def _pack(c0, c1, c2, c3):
    """Four 2-bit code tiles -> one byte tile, tile i at bits 2i (tile i holds element 4j+i of the packed dim)."""
    return ((c0 & 3) | (c1 & 3) << 2 | (c2 & 3) << 4 | (c3 & 3) << 6).to(tl.uint8)


@triton.jit
def _min4(x0, x1, x2, x3, mask, axis: tl.constexpr):
    big = float("inf")
    lo = tl.minimum(tl.minimum(tl.where(mask, x0, big), tl.where(mask, x1, big)),
                    tl.minimum(tl.where(mask, x2, big), tl.where(mask, x3, big)))
    return tl.min(lo, axis=axis)


@triton.jit
def _max4(x0, x1, x2, x3, mask, axis: tl.constexpr):
    small = float("-inf")
    hi = tl.maximum(tl.maximum(tl.where(mask, x0, small), tl.where(mask, x1, small)),
                    tl.maximum(tl.where(mask, x2, small), tl.where(mask, x3, small)))
    return tl.max(hi, axis=axis)


# The tiles are kept 2-D, one per position in a byte (no 3-D tensors or reshapes): Triton 3.6 fails to compile
# the 3-D form of this kernel for head_dim 128 (a layout pass breaks SSA dominance).
@triton.jit
def _quantize_keys_kernel(x_ptr, idx_ptr, low_ptr, high_ptr, scale_ptr, zero_ptr,
                          G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)                              # one (page, head)
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_G4)
    dmask = d < D
    mask = dmask[:, None] & (j < G // 4)[None, :]
    src = x_ptr + pid * G * D + d[:, None] + (4 * j[None, :]) * D    # (channel, token 4j) tile; +i*D: token 4j+i
    x0 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(src + D, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * D, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(src + 3 * D, mask=mask, other=0.0).to(tl.float32)
    idx = tl.load(idx_ptr + pid * D + d, mask=dmask, other=255).to(tl.int32)
    boosted = idx < NB
    levels = tl.where(boosted, 15.0, 3.0)
    scale, zero = _params(_min4(x0, x1, x2, x3, mask, 1), _max4(x0, x1, x2, x3, mask, 1), levels)
    s, z, lv = scale[:, None], zero[:, None], levels[:, None]
    c0 = _encode(x0, mask, s, z, lv)
    c1 = _encode(x1, mask, s, z, lv)
    c2 = _encode(x2, mask, s, z, lv)
    c3 = _encode(x3, mask, s, z, lv)
    tl.store(low_ptr + pid * D * (G // 4) + d[:, None] * (G // 4) + j[None, :], _pack(c0, c1, c2, c3), mask=mask)
    if NB > 0:
        rows = tl.minimum(idx, NB - 1)[:, None]                      # masked below for unboosted channels
        tl.store(high_ptr + pid * NB * (G // 4) + rows * (G // 4) + j[None, :],
                 _pack(c0 >> 2, c1 >> 2, c2 >> 2, c3 >> 2), mask=mask & (rows == idx[:, None]))
    tl.store(scale_ptr + pid * D + d, scale, mask=dmask)
    tl.store(zero_ptr + pid * D + d, zero, mask=dmask)


@triton.jit
def _quantize_values_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, zero_ptr,
                            G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_D4: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D4)
    tmask = t < G
    mask = tmask[:, None] & (c < D // 4)[None, :]
    src = x_ptr + pid * G * D + t[:, None] * D + 4 * c[None, :]      # (token, channel 4c) tile; +i: channel 4c+i
    x0 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(src + 3, mask=mask, other=0.0).to(tl.float32)
    levels = 2.0 ** BITS - 1.0
    scale, zero = _params(_min4(x0, x1, x2, x3, mask, 1), _max4(x0, x1, x2, x3, mask, 1), levels)
    s, z = scale[:, None], zero[:, None]
    c0 = _encode(x0, mask, s, z, levels)
    c1 = _encode(x1, mask, s, z, levels)
    c2 = _encode(x2, mask, s, z, levels)
    c3 = _encode(x3, mask, s, z, levels)
    offs = pid * G * (D // 4) + t[:, None] * (D // 4) + c[None, :]
    tl.store(low_ptr + offs, _pack(c0, c1, c2, c3), mask=mask)
    if BITS == 4:
        tl.store(high_ptr + offs, _pack(c0 >> 2, c1 >> 2, c2 >> 2, c3 >> 2), mask=mask)
    tl.store(scale_ptr + pid * G + t, scale, mask=tmask)
    tl.store(zero_ptr + pid * G + t, zero, mask=tmask)


def quantize_keys(x: torch.Tensor, idx: torch.Tensor, n_boost: int):
    """Triton launch of quantize_keys_ref (same arguments, same results bit for bit)."""
    n, h, g, d = x.shape
    x = x.contiguous()
    low = torch.empty((n, h, d, g // 4), dtype=torch.uint8, device=x.device)
    high = torch.empty((n, h, n_boost, g // 4), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n, h, d), dtype=SCALE_DTYPE, device=x.device)
    zero = torch.empty_like(scale)
    if n * h:
        _quantize_keys_kernel[(n * h,)](x, idx.contiguous(), low, high, scale, zero, G=g, D=d, NB=n_boost,
                                        BLOCK_D=triton.next_power_of_2(d),
                                        BLOCK_G4=triton.next_power_of_2(g // 4), num_warps=4)
    return low, high, scale, zero


def quantize_values(x: torch.Tensor, bits: int):
    """Triton launch of quantize_values_ref (same arguments, same results bit for bit)."""
    n, h, g, d = x.shape
    x = x.contiguous()
    low = torch.empty((n, h, g, d // 4), dtype=torch.uint8, device=x.device)
    high = torch.empty((n, h, g if bits == 4 else 0, d // 4), dtype=torch.uint8, device=x.device)
    scale = torch.empty((n, h, g), dtype=SCALE_DTYPE, device=x.device)
    zero = torch.empty_like(scale)
    if n * h:
        _quantize_values_kernel[(n * h,)](x, low, high, scale, zero, G=g, D=d, BITS=bits,
                                          BLOCK_G=triton.next_power_of_2(g),
                                          BLOCK_D4=triton.next_power_of_2(d // 4), num_warps=4)
    return low, high, scale, zero
