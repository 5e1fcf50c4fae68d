"""Attention of a chunk of new tokens over each sequence's cached tokens and itself, for a ragged batch.

This is what a further prompt on a filled cache needs (the next chunk of a chunked prefill, the next turn of a
chat): sequence b has `past[b]` cached tokens and `counts[b]` real chunk tokens (the last of the chunk: left
padding before them), its keys laid out [cached | real chunk tokens], so attention is causal aligned to the lower
right and needs no mask tensor. Torch SDPA runs once per run of consecutive sequences with the same cached length
and real count: a batch of equal lengths (the usual chunked prefill) is one call, each sequence of a ragged batch
(a chat's next turn) its own. On CUDA SDPA runs flash attention, never a (B, HQ, n, L) score tensor.

Why not one call for a ragged batch: torch's variable-length flash attention (`torch.nn.attention.varlen`) takes
grouped-query heads and per-sequence key lengths (`enable_gqa`, `seqused_k`) in torch 2.13, not in the H200's torch
2.11, which would need the keys and values copied out to every query head (4x for Qwen3-8B) and packed. Measured
there (BENCHMARKS.md section 2, "a chat's next turn"), the 16 calls of a ragged batch of 16 take 1.6-3.0 ms a layer.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: np.ndarray,
                    counts: np.ndarray, scaling: float) -> torch.Tensor:
    """query (B, HQ, n, D); keys, values (B, H, W, D): sequence b's past[b] cached tokens, then its counts[b] real
    chunk tokens, then anything (W >= past + counts). Returns (B, n, HQ, D): each real query row attends causally
    over its sequence's keys; padding rows are zeros."""
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
