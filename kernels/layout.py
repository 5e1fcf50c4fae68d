"""Page layout and bit accounting, shared by the kernels, their references and the cache.

Key page (one per G tokens, all KV heads of one sequence), dense-sparse decomposition of the paper (Sec. 4.1):
    low   (H, G/4, D)   uint8  low 2 bits of every channel: byte [j, d] holds channel d of tokens j + i*G/4 at
                               bits 2i (i = 0..3, "token quarters")
    high  (H, G/4, NB)  uint8  the same for the high 2 bits of the NB boosted channels only (NB = D for 4-bit
                               keys, 0 for KIVI-K2)
    ch    (H, NB)       uint8  the boosted channels, ascending: row r of `high` is channel ch[r]
    scale (H, D) fp16, zero (H, D) fp16: asymmetric min-max per channel; k = (low | high << 2) * scale + zero
Value page (per-token quantization, KIVI style):
    low   (H, D/4, G)   uint8  low 2 bits of every channel: byte [c, t] holds token t's channels c + i*D/4 at
                               bits 2i ("channel quarters")
    high  (H, D/4, G)   uint8  high 2 bits, only for 4-bit values (0 rows for 2-bit values)
    scale (H, G) fp16, zero (H, G) fp16: per token

Why this order: the decode kernel contracts keys over channels and values over tokens, so each plane keeps its
contracted dimension contiguous (a matrix-unit operand is then one 32-bit word of 4 consecutive elements, read
straight from shared memory with ldmatrix), and the four 2-bit fields of a byte are four contiguous quarters of
the other dimension (each quarter is a dense operand of its own: no register re-layout after unpacking).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
FP_DTYPE = torch.float16        # full-precision parts (sink, buffers, value window) are stored at 16 bits


def key_page_bytes(heads: int, head_dim: int, page_size: int, boosted: int) -> int:
    """Bytes of one key page (all heads): both bit planes, the boosted-channel list and FP16 scale/zero."""
    planes = head_dim * page_size // 4 + boosted * page_size // 4
    return heads * (planes + boosted + 2 * 2 * head_dim)


def value_page_bytes(heads: int, head_dim: int, page_size: int, bits: int) -> int:
    """Bytes of one value page (all heads): one bit plane per 2 bits and FP16 scale/zero per token."""
    planes = (bits // 2) * page_size * head_dim // 4
    return heads * (planes + 2 * 2 * page_size)


def pack_quarters(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 2-bit codes along `dim` (length n, a multiple of 4) into n/4 bytes: element j + i*n/4 lands in
    byte j at bits 2i."""
    q = codes.to(torch.int32).movedim(dim, -1)
    q = q.reshape(*q.shape[:-1], 4, q.shape[-1] // 4)
    shifts = torch.arange(0, 8, 2, device=q.device, dtype=torch.int32).unsqueeze(-1)
    return ((q & 3) << shifts).sum(-2).to(torch.uint8).movedim(-1, dim).contiguous()


def unpack_quarters(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of pack_quarters: n/4 bytes along `dim` -> n int32 codes in 0..3."""
    p = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-2)
    shifts = torch.arange(0, 8, 2, device=p.device, dtype=torch.int32).unsqueeze(-1)
    q = (p >> shifts) & 3
    return q.reshape(*q.shape[:-2], 4 * q.shape[-1]).movedim(-1, dim)


def boost_mask(ch: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(..., NB) boosted-channel lists -> (..., D) bool masks, True where a channel is stored at 4 bits."""
    mask = torch.zeros((*ch.shape[:-1], head_dim), dtype=torch.bool, device=ch.device)
    return mask.scatter_(-1, ch.long(), True) if ch.shape[-1] else mask


@dataclass
class PagedKV:
    """One layer's cache as the attention kernels read it (B sequences, H KV heads, head_dim D).

    Token t of sequence b lives in:
      keys:   k_fp[b, :, t] if t < sink; key page k_table[b, p] slot i if t = sink + p*G + i and p < n_kpages[b];
              else k_fp[b, :, sink + (t - sink - n_kpages[b]*G)]  (the key Q-buffer, or everything for 16-bit keys)
      values: the same with v_fp, v_table and n_vpages (the FP16 tail there is value Q-buffer + local window).
    """

    k_fp: torch.Tensor          # (B, H, CK, D) 16-bit
    v_fp: torch.Tensor          # (B, H, CV, D)
    k_low: torch.Tensor         # (P, H, G/4, D) uint8
    k_high: torch.Tensor        # (P, H, G/4, NB) uint8
    k_ch: torch.Tensor          # (P, H, NB) uint8
    k_scale: torch.Tensor       # (P, H, D) fp16
    k_zero: torch.Tensor        # (P, H, D) fp16
    v_low: torch.Tensor         # (P', H, D/4, G) uint8
    v_high: torch.Tensor        # (P', H, D/4 or 0, G) uint8
    v_scale: torch.Tensor       # (P', H, G) fp16
    v_zero: torch.Tensor        # (P', H, G) fp16
    k_table: torch.Tensor       # (B, MP) int32 page ids
    v_table: torch.Tensor       # (B, MP) int32
    seq_len: torch.Tensor       # (B,) int32 valid tokens (padding is never stored)
    n_kpages: torch.Tensor      # (B,) int32
    n_vpages: torch.Tensor      # (B,) int32
    sink: int
    page_size: int
    n_boost: int
    v_bits: int
