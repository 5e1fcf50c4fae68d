"""A chunk's attention over a ragged batch (kernels/chunk_attention.py: the Triton kernel, interpreted on a CPU, and
the PyTorch path) against a per-sequence float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DEVICE
from kernels.chunk_attention import chunk_attention


def reference(query, keys, values, past, counts, scaling) -> torch.Tensor:
    """Each real query row of sequence b (the last counts[b] of the chunk) over keys 0 .. its own position."""
    bsz, hq, n, d = query.shape
    group = hq // keys.shape[1]
    out = torch.zeros(bsz, n, hq, d, dtype=torch.float64)
    for b in range(bsz):
        real, cached = int(counts[b]), int(past[b])
        for i in range(n - real, n):
            position = cached + i - (n - real)                       # the token's place in its sequence
            k = keys[b, :, :position + 1].double().repeat_interleave(group, 0)
            v = values[b, :, :position + 1].double().repeat_interleave(group, 0)
            p = torch.softmax((k @ query[b, :, i].double()[:, :, None])[..., 0] * scaling, dim=-1)
            out[b, i] = (p[:, None, :] @ v)[:, 0]
    return out


def ragged(bsz, hq, h, d, n, past, counts, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = int(max(np.asarray(past) + np.asarray(counts))) + 3               # room past the longest, as _dense has
    query = torch.randn(bsz, hq, n, d, generator=gen).to(dtype)
    keys = torch.randn(bsz, width, h, d, generator=gen).to(dtype).transpose(1, 2)   # (B, W, H, D) storage
    values = torch.randn(bsz, width, h, d, generator=gen).to(dtype).transpose(1, 2)
    return query, keys, values


SHAPES = [  # (query heads, KV heads, head_dim, chunk, cached lengths, real counts)
    (4, 4, 64, 5, [7, 7, 3], [5, 5, 2]),              # GQA 1, two equal sequences share a call, a shorter one
    (6, 2, 128, 4, [9, 0, 5, 5], [4, 3, 0, 1]),       # GQA 3, an empty cache, a sequence with no real token
    (8, 2, 64, 3, [1, 11], [3, 3]),                   # GQA 4
    (8, 1, 64, 6, [13, 4, 8], [2, 6, 5]),             # GQA 8, odd lengths
]


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("hq,h,d,n,past,counts", SHAPES)
def test_chunk_attention_matches_the_reference_on_ragged_batches(hq, h, d, n, past, counts, use_triton):
    query, keys, values = ragged(len(past), hq, h, d, n, past, counts, torch.float32)
    out = chunk_attention(*(t.to(DEVICE) for t in (query, keys, values)), np.array(past), np.array(counts), 0.3,
                          use_triton).cpu()
    torch.testing.assert_close(out.double(), reference(query, keys, values, past, counts, 0.3), atol=1e-5, rtol=1e-5)
    padding = torch.arange(n)[None, :] < (n - torch.tensor(counts))[:, None]
    assert not out[padding].any()                                       # padding rows are zeros


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunk_attention_kernel_in_half_precision_over_several_key_blocks(dtype):
    """The Triton kernel with 16-bit inputs, head_dim 128, GQA 4 and cached lengths of several key blocks (odd, one
    empty) and a chunk longer than one program's rows: within 16-bit rounding of the float64 reference (on a CPU the
    interpreter computes in float32, kernels/decode_attention.py's dot_dtype)."""
    past, counts, n = [150, 0, 77], [20, 3, 19], 20
    query, keys, values = ragged(3, 8, 2, 128, n, past, counts, dtype, seed=2)
    out = chunk_attention(*(t.to(DEVICE) for t in (query, keys, values)), np.array(past), np.array(counts), 0.088,
                          True).cpu()
    expected = reference(query, keys, values, past, counts, 0.088)
    assert out.dtype == dtype
    assert (out.double() - expected).norm() / expected.norm() < 1e-2
