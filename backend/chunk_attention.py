"""Attention of a chunk of new tokens over each sequence's cached tokens and itself, for a ragged batch.

This is what a further prompt on a filled cache needs (the next chunk of a chunked prefill, the next turn of a
chat): sequence b has `past[b]` cached tokens and `counts[b]` real chunk tokens (the last of the chunk: left
padding before them), its keys laid out [cached | real chunk tokens], so attention is causal aligned to the lower
right and needs no mask tensor.

Two kernels, the same result:
- "grouped": torch SDPA once per run of consecutive sequences with the same cached length and real count (a batch
  of equal lengths, the usual chunked prefill, is one call; every sequence of a ragged batch is its own call). SDPA
  runs flash attention on CUDA: never a (B, HQ, n, L) score tensor. Works on any device.
- "varlen": torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) takes the whole
  ragged batch in one call: packed real queries, each sequence's keys read in place up to its own length
  (`seqused_k`). CUDA only, and only with a torch whose varlen_attn has GQA, a scale, causal windows and
  `seqused_k` (see varlen_supported).
"auto" takes varlen where it is supported, else grouped.
"""
from __future__ import annotations

import inspect

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

KERNELS = ("auto", "grouped", "varlen")
VARLEN_ARGUMENTS = {"scale", "window_size", "enable_gqa", "seqused_k"}


def varlen_supported(device: torch.device) -> bool:
    """Whether torch's varlen_attn can run a ragged chunk on `device` (a CUDA device, and the arguments we need)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return VARLEN_ARGUMENTS <= set(inspect.signature(varlen_attn).parameters)


def chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: np.ndarray,
                    counts: np.ndarray, scaling: float, kernel: str = "auto") -> torch.Tensor:
    """query (B, HQ, n, D); keys, values (B, H, W, D): sequence b's past[b] cached tokens, then its counts[b] real
    chunk tokens, then anything (W >= past + counts). Returns (B, n, HQ, D): each real query row attends causally
    over its sequence's keys; padding rows are zeros."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    supported = varlen_supported(query.device)
    if kernel == "varlen" and not supported:
        raise ValueError("kernel='varlen' needs a CUDA device and torch.nn.attention.varlen.varlen_attn with the "
                         f"arguments {sorted(VARLEN_ARGUMENTS)} (a newer torch); use kernel='grouped'")
    past, counts = np.asarray(past), np.asarray(counts)
    if kernel == "varlen" or (kernel == "auto" and supported):
        return _varlen(query, keys, values, past, counts, scaling)
    return _grouped(query, keys, values, past, counts, scaling)


def _grouped(query, keys, values, past, counts, scaling) -> torch.Tensor:
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


def _varlen(query, keys, values, past, counts, scaling) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    bsz, _, n, _ = query.shape
    width = keys.shape[2]
    device = query.device
    out = query.new_zeros((bsz, n, query.shape[1], query.shape[3]))
    real = torch.arange(n, device=device)[None, :] >= torch.as_tensor(n - counts, device=device)[:, None]
    packed_q = query.transpose(1, 2)[real]                                    # (sum(counts), HQ, D)
    if not packed_q.shape[0]:
        return out
    cu_q = torch.as_tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device=device)
    # every sequence's key rows start at b * width of the (B * W, H, D) storage and end at its own length
    cu_k = torch.arange(bsz + 1, dtype=torch.int32, device=device) * width
    used = torch.as_tensor(past + counts, dtype=torch.int32, device=device)
    flat_k, flat_v = (t.transpose(1, 2).reshape(bsz * width, t.shape[1], t.shape[3]) for t in (keys, values))
    attended = varlen_attn(packed_q, flat_k, flat_v, cu_q, cu_k, int(counts.max()), width, scale=scaling,
                           window_size=(-1, 0), enable_gqa=True, seqused_k=used)
    out[real] = attended
    return out
