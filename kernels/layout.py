"""Page layout and bit accounting, shared by the kernels, their references and the cache.

Key page (one per G tokens, all KV heads of one sequence), dense-sparse decomposition of the paper (Sec. 4.1):
    low   (H, D, G/4)   uint8  low 2 bits of every channel, 4 consecutive tokens per byte (token 4j+i at bits 2i)
    high  (H, NB, G/4)  uint8  high 2 bits of the NB boosted channels only (NB = D for 4-bit keys, 0 for KIVI-K2)
    idx   (H, D)        uint8  row of a channel in `high`, NO_BOOST for channels kept at 2 bits
    scale (H, D) fp16, zero (H, D) fp16: asymmetric min-max per channel; k = (low | high << 2) * scale + zero
Value page (per-token quantization, KIVI style):
    low   (H, G, D/4)   uint8  low 2 bits of every channel, 4 consecutive channels per byte
    high  (H, G, D/4)   uint8  high 2 bits, only for 4-bit values (the same two-plane scheme as keys)
    scale (H, G) fp16, zero (H, G) fp16: per token
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NO_BOOST = 255  # sentinel in `idx`; kernels test `idx < NB`, so any value >= NB means "not boosted"
SCALE_DTYPE = torch.float16


def key_page_bytes(heads: int, head_dim: int, page_size: int, boosted: int) -> int:
    """Bytes of one key page (all heads): both bit planes, the boost index and FP16 scale/zero."""
    planes = head_dim * page_size // 4 + boosted * page_size // 4
    return heads * (planes + head_dim + 2 * 2 * head_dim)


def value_page_bytes(heads: int, head_dim: int, page_size: int, bits: int) -> int:
    """Bytes of one value page (all heads): one bit plane per 2 bits and FP16 scale/zero per token."""
    planes = (bits // 2) * page_size * head_dim // 4
    return heads * (planes + 2 * 2 * page_size)


def pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes 4 per byte along the last dim: element 4j+i lands in byte j at bits 2i."""
    q = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
    shifts = torch.arange(0, 8, 2, device=q.device, dtype=torch.int32)
    return ((q & 3) << shifts).sum(-1).to(torch.uint8)


def unpack_2bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_2bit: (..., n/4) uint8 -> (..., n) int32 codes in 0..3."""
    shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.int32)
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 3
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 4)


@dataclass
class PagedKV:
    """One layer's cache as the attention kernels read it (B sequences, H KV heads, head_dim D).

    Token t of sequence b lives in:
      keys:   k_fp[b, :, t] if t < sink; key page k_table[b, p] slot i if t = sink + p*G + i and p < n_kpages[b];
              else k_fp[b, :, sink + (t - sink - n_kpages[b]*G)]  (the key Q-buffer, or everything for 16-bit keys)
      values: the same with v_fp, v_table and n_vpages (the FP16 tail there is value Q-buffer + local window).
    """

    k_fp: torch.Tensor          # (B, H, CK, D) model dtype
    v_fp: torch.Tensor          # (B, H, CV, D)
    k_low: torch.Tensor         # (P, H, D, G/4) uint8
    k_high: torch.Tensor        # (P, H, NB, G/4) uint8
    k_idx: torch.Tensor         # (P, H, D) uint8
    k_scale: torch.Tensor       # (P, H, D) fp16
    k_zero: torch.Tensor        # (P, H, D) fp16
    v_low: torch.Tensor         # (P', H, G, D/4) uint8
    v_high: torch.Tensor        # (P', H, G or 0, D/4) uint8
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
