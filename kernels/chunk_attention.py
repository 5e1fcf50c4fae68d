"""A chunk of new tokens attending over a ragged batch's dense keys and values, in one launch.

This is the attention of a further prompt on a filled cache (the next turn of a chat, the next chunk of a chunked
prefill): sequence b has past[b] cached tokens and counts[b] real chunk tokens, the last counts[b] of the chunk's n
(left padding before them), and its keys and values laid out [cached | real chunk tokens] (the cache's dense read,
backend/cache.py's _dense). Row i of the chunk, if real, sits at position past[b] + i - (n - counts[b]) of its
sequence and attends causally over positions 0 .. that one.

The Triton kernel is flash attention (online softmax over blocks of keys, no score tensor in memory), with the query
heads of a KV group on the rows of one tile so that each key and value block is read once for the whole group: a
program takes BLOCK_Q chunk rows x GROUP query heads of one (sequence, KV head). Lengths come from device tensors,
so a batch of any lengths is one launch. The PyTorch reference (the CPU path) runs torch SDPA once per run of
consecutive sequences with the same cached length and real count: a batch of equal lengths (the usual chunked
prefill) is one call, each sequence of a ragged batch its own, which on a GPU left the forward bound by the host
issuing them (16 calls a layer for a ragged batch of 16: BENCHMARKS.md section 2).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from .decode_attention import dot_dtype, precision

BLOCK_N = 64            # keys a step


@triton.jit
def _chunk_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, past_ptr, count_ptr, qk_scale, N,
                            sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_n, so_h,
                            H: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT: tl.constexpr, PREC: tl.constexpr):
    """Program (b * H + h, block): chunk rows block * BLOCK_Q .. + BLOCK_Q of sequence b, for the GROUP query heads
    of KV head h. Tile row r is chunk row block * BLOCK_Q + r // GROUP_P2 and query head h * GROUP + r % GROUP_P2
    (rows of heads past the group, of padding or past the chunk are computed as empty and not stored)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    past = tl.load(past_ptr + b)
    count = tl.load(count_ptr + b)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    r = tl.arange(0, BLOCK_M)
    row = tl.program_id(1) * BLOCK_Q + r // GROUP_P2                # chunk row
    head = h * GROUP + r % GROUP_P2                                 # query head
    pad = N - count
    real = (row < N) & (row >= pad) & (r % GROUP_P2 < GROUP)
    pos = past + row - pad                                          # the row's position in its sequence
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + head[:, None] * sq_h + row[:, None] * sq_n + d[None, :],
                mask=real[:, None] & dmask[None, :], other=0.0).to(DOT)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # keys up to the last real row's position: past + min(last row, N - 1) - pad
    # (none where the block holds no real row)
    last_row = tl.minimum(tl.program_id(1) * BLOCK_Q + BLOCK_Q - 1, N - 1)
    last = tl.where(last_row >= pad, past + last_row - pad, -1)
    k_rows = k_ptr + b.to(tl.int64) * sk_b + h * sk_h
    v_rows = v_ptr + b.to(tl.int64) * sv_b + h * sv_h
    for start in range(0, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jmask = j <= last
        k = tl.load(k_rows + j[:, None] * sk_n + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * qk_scale
        s = tl.where(real[:, None] & (j[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)        # rows with nothing yet: all weights 0
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows + j[:, None] * sv_n + d[None, :], mask=jmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * so_b + row[:, None] * so_n + head[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(row < N)[:, None] & (r % GROUP_P2 < GROUP)[:, None]
             & dmask[None, :])


def chunk_attention_triton(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: np.ndarray,
                           counts: np.ndarray, scaling: float,
                           device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """query (B, HQ, n, D); keys, values (B, H, W, D) (any strides with contiguous channels): sequence b's past[b]
    cached tokens, then its counts[b] real chunk tokens, then anything (W >= past + counts). Returns (B, n, HQ, D):
    each real query row attends causally over its sequence's keys; padding rows are zeros (written here).
    device_lengths: past and counts already on the device (a cache's pinned copies), else copied here."""
    bsz, hq, n, d = query.shape
    h = keys.shape[1]
    group = hq // h
    out = torch.empty((bsz, n, hq, d), dtype=query.dtype, device=query.device)
    lengths = device_lengths or torch.as_tensor(np.stack([np.asarray(past), np.asarray(counts)]), dtype=torch.int32,
                                                device=query.device)
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, 64 // group_p2)                   # 64-row tiles: 16 chunk rows of a 4-head group
    dot = dot_dtype(query.dtype)
    for t in (query, keys, values):
        assert t.stride(-1) == 1, "channels must be contiguous"
    _chunk_attention_kernel[(bsz * h, triton.cdiv(n, block_q))](
        query, keys, values, out, lengths[0], lengths[1], scaling * math.log2(math.e), n,
        *query.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *out.stride()[:3],
        H=h, GROUP=group, GROUP_P2=group_p2, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N, DOT=dot, PREC=precision(dot), num_warps=4)
    return out


def chunk_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: np.ndarray,
                        counts: np.ndarray, scaling: float) -> torch.Tensor:
    """chunk_attention_triton's contract in PyTorch: torch SDPA (lower-right causal) once per run of consecutive
    sequences with the same cached length and real count. On CUDA SDPA runs flash attention, never a (B, HQ, n, L)
    score tensor."""
    past, counts = np.asarray(past), np.asarray(counts)
    bsz, _, n, _ = query.shape
    out = query.new_zeros((bsz, n, query.shape[1], query.shape[3]))
    starts = np.flatnonzero((np.diff(past, prepend=-1) != 0) | (np.diff(counts, prepend=-1) != 0))
    for b0, b1 in zip(starts, [*starts[1:], bsz]):
        cached, real = int(past[b0]), int(counts[b0])
        if real:
            attended = torch.nn.functional.scaled_dot_product_attention(
                query[b0:b1, :, n - real:], keys[b0:b1, :, :cached + real], values[b0:b1, :, :cached + real],
                attn_mask=causal_lower_right(real, cached + real), scale=scaling, enable_gqa=True)
            out[b0:b1, n - real:] = attended.transpose(1, 2)
    return out


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: np.ndarray,
                    counts: np.ndarray, scaling: float, use_triton: bool,
                    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The chunk's attention (the contract of chunk_attention_triton): the Triton kernel, one launch for any
    lengths, or the PyTorch reference (the CPU path)."""
    if use_triton:
        return chunk_attention_triton(query, keys, values, past, counts, scaling, device_lengths)
    return chunk_attention_ref(query, keys, values, past, counts, scaling)
