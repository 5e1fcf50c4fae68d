"""Dequantization of whole pages (the paper's Algorithm 1 for keys; per-token for values).

The decode-attention kernel never calls these: it dequantizes in registers. They serve the paths that need
full-precision pages: a further prompt chunk on a filled cache (pages written straight into each sequence's rows of
a dense (B, L, H, D) tensor: `dequantize_pages_into`, one launch per kind on a GPU), analysis, and tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import key_offsets, key_rows, key_tile, unpack_quarters, value_rows, value_tile


# ---------------------------------------------------------------------------------------------- references
def key_codes_ref(low: torch.Tensor, high: torch.Tensor, ch: torch.Tensor) -> torch.Tensor:
    """(N, H, G, D) integer codes of key pages: low | high << 2, high only in the boosted channels ch."""
    code = unpack_quarters(key_rows(low), dim=2)
    if ch.shape[-1]:
        cols = ch.long().unsqueeze(2).expand(-1, -1, code.shape[2], -1)         # (N, H, G, NB)
        code = code.scatter(3, cols, code.gather(3, cols) | unpack_quarters(key_rows(high), dim=2) << 2)
    return code


def dequantize_keys_ref(low, high, ch, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Key pages -> (N, H, G, D) in `dtype`."""
    code = key_codes_ref(low, high, ch).float()
    return (code * scale.float().unsqueeze(2) + zero.float().unsqueeze(2)).to(dtype)


def value_codes_ref(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(N, H, D, G) integer codes of value pages (planes (N, H, 4, D/4, G/4); `high` has no quarters for 2-bit
    values)."""
    code = unpack_quarters(value_rows(low), dim=2)
    if high.shape[2]:
        code = code | unpack_quarters(value_rows(high), dim=2) << 2
    return code


def dequantize_values_ref(low, high, scale, zero, dtype=torch.float16) -> torch.Tensor:
    """Value pages (N, H, 4, D/4, G/4) planes -> (N, H, G, D) in `dtype`; `high` has no quarters for 2-bit values."""
    code = value_codes_ref(low, high)                                           # (N, H, D, G)
    v = code.transpose(2, 3).float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return v.to(dtype)


KEY_PLANES = ("low", "high", "ch", "scale", "zero")
VALUE_PLANES = ("low", "high", "scale", "zero")


def dequantize_pages_into_ref(out: torch.Tensor, kind: str, pool: dict, ids: torch.Tensor, seqs: torch.Tensor,
                              starts: torch.Tensor) -> None:
    """out (B, L, H, D): for each i, page ids[i] of the pool's `kind` ("key" or "value") pages (all heads) written,
    dequantized to out's dtype, into out[seqs[i], starts[i] : starts[i] + page_size]."""
    ids = ids.long()
    if kind == "key":
        pages = dequantize_keys_ref(*(pool[name][ids] for name in KEY_PLANES), out.dtype)
    else:
        pages = dequantize_values_ref(*(pool[name][ids] for name in VALUE_PLANES), out.dtype)
    tokens = starts.long()[:, None] + torch.arange(pages.shape[2], device=out.device)      # (pages, G)
    out[seqs.long()[:, None], tokens] = pages.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _key_pages_into_kernel(low_ptr, high_ptr, ch_ptr, scale_ptr, zero_ptr, ids_ptr, seqs_ptr, starts_ptr, out_ptr,
                           stride_b, stride_t, stride_h, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                           NB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Program (i, h): head h of key page ids[i] into out[seqs[i], starts[i] + token, h, :]."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(ids_ptr + i).to(tl.int64) * H + h                           # the pool's (page, head) row
    b = tl.load(seqs_ptr + i).to(tl.int64)
    t0 = tl.load(starts_ptr + i).to(tl.int64)
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    mask = (j < G4)[:, None] & dmask[None, :]
    low = key_tile(low_ptr + page * G4 * D, j, d, mask, G4, D).to(tl.int32)
    high = tl.zeros((BLOCK_G4, BLOCK_D), tl.int32)
    if NB > 0:
        # each channel's row in the high plane (boosted channels only), so both planes combine in one tile
        r = tl.arange(0, BLOCK_NB)
        ch = tl.load(ch_ptr + page * NB + r, mask=r < NB, other=BLOCK_D).to(tl.int32)   # padding matches no channel
        hit = ch[None, :] == d[:, None]                                        # (channel, row)
        row = tl.sum(tl.where(hit, r[None, :], 0), axis=1)
        boosted = tl.sum(hit.to(tl.int32), axis=1) > 0
        high = tl.load(high_ptr + page * G4 * NB + key_offsets(j, row, G4, NB),
                       mask=(j < G4)[:, None] & boosted[None, :], other=0).to(tl.int32)
    scale = tl.load(scale_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    zero = tl.load(zero_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + b * stride_b + (t0 + j[:, None]) * stride_t + h * stride_h + d[None, :]
    for quarter in tl.static_range(4):                                         # tokens j + quarter * G4
        code = ((low >> (2 * quarter)) & 3) | (((high >> (2 * quarter)) & 3) << 2)
        tl.store(out + quarter * G4 * stride_t, (code.to(tl.float32) * scale + zero).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _value_pages_into_kernel(low_ptr, high_ptr, scale_ptr, zero_ptr, ids_ptr, seqs_ptr, starts_ptr, out_ptr,
                             stride_b, stride_t, stride_h, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                             BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D4: tl.constexpr):
    """Program (i, h): head h of value page ids[i] into out[seqs[i], starts[i] + token, h, :]."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(ids_ptr + i).to(tl.int64) * H + h
    b = tl.load(seqs_ptr + i).to(tl.int64)
    t0 = tl.load(starts_ptr + i).to(tl.int64)
    D4: tl.constexpr = D // 4
    t = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D4)
    tmask = t < G
    mask = tmask[:, None] & (c < D4)[None, :]
    low = value_tile(low_ptr + page * D4 * G, c[None, :], t[:, None], mask, G, D4, 0).to(tl.int32)
    if BITS == 4:
        high = value_tile(high_ptr + page * D4 * G, c[None, :], t[:, None], mask, G, D4, 0).to(tl.int32)
    scale = tl.load(scale_ptr + page * G + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(zero_ptr + page * G + t, mask=tmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + b * stride_b + (t0 + t[:, None]) * stride_t + h * stride_h + c[None, :]
    for quarter in tl.static_range(4):                                         # channels c + quarter * D4
        code = (low >> (2 * quarter)) & 3
        if BITS == 4:
            code = code | (((high >> (2 * quarter)) & 3) << 2)
        tl.store(out + quarter * D4, (code.to(tl.float32) * scale + zero).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_pages_into(out: torch.Tensor, kind: str, pool: dict, ids: torch.Tensor, seqs: torch.Tensor,
                          starts: torch.Tensor) -> None:
    """Triton launch of dequantize_pages_into_ref: one program per (page, head), no intermediate tensor."""
    if out.stride(3) != 1:
        raise ValueError("dequantize_pages_into needs out's channels contiguous")
    n, heads = ids.numel(), out.shape[2]
    if not n:
        return
    strides = (out.stride(0), out.stride(1), out.stride(2))
    if kind == "key":
        _, _, chunks, g4, c = pool["low"].shape
        d = chunks * c
        nb = pool["ch"].shape[-1]
        _key_pages_into_kernel[(n, heads)](*(pool[name] for name in KEY_PLANES), ids, seqs, starts, out, *strides,
                                           H=heads, G=4 * g4, D=d, NB=nb, BLOCK_D=triton.next_power_of_2(d),
                                           BLOCK_G4=triton.next_power_of_2(g4),
                                           BLOCK_NB=triton.next_power_of_2(max(nb, 1)), num_warps=4)
    else:
        _, _, _, d4, g4 = pool["low"].shape
        g = 4 * g4
        _value_pages_into_kernel[(n, heads)](*(pool[name] for name in VALUE_PLANES), ids, seqs, starts, out,
                                             *strides, H=heads, G=g, D=4 * d4,
                                             BITS=4 if pool["high"].shape[2] else 2, BLOCK_G=triton.next_power_of_2(g),
                                             BLOCK_D4=triton.next_power_of_2(d4), num_warps=4)
