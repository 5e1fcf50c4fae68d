"""The numbers of decode_attention(kernel="gluon-tma-i8k" / "gluon-tma-i8") in PyTorch: its 8-bit roundings done the
way decode_gluon.py does them, each page's against the running maximum a program has after it, so that a GPU test can
hold the kernel to its own arithmetic (within float tolerance) and say separately how far that arithmetic is from the
exact reference.

Keys (both kernels): per page and KV-head group member, the queries times the page's key scales (fp16, times
decode_gluon.Q_SCALE; boosted channels' high bits times 4) are multiplied by r = 127 / (their largest magnitude) in
fp16 and rounded to integers; a score is sum(rounded * code) / r plus the exact q . zero. Values ("gluon-tma-i8"):
p * scale (fp16) is multiplied by r = min(127 / (largest value scale x the page's largest p), 65,504) in fp16 and
rounded. One program takes all of a sequence's pages (num_splits=1), so the running maximum is the one a program
keeps; the sink and buffers, summed apart by the remaining blocks' kernel, are exact.
"""
from __future__ import annotations

import math

import torch

from .decode_attention import gather_kv
from .dequantize import key_codes_ref, value_codes_ref
from .layout import PagedKV

Q_SCALE = 1.0 / 16              # decode_gluon.Q_SCALE
AMAX_FLOOR = 2.0 ** -9          # decode_gluon.I8_AMAX_FLOOR: 127 / AMAX_FLOOR = 65,024, finite in fp16
# decode_attention's 8-bit kernels -> whether they round the value products too (decode_gluon.I8_PRODUCTS == 2). A
# cache that decodes with one of them and runs no Triton (a CPU) decodes with this module's arithmetic instead of the
# exact reference, at any shape, so that what the 8-bit products cost a real model can be measured without a GPU
# (`python -m backend.bench quality`)
I8_KERNELS = {"gluon-tma-i8k": False, "gluon-tma-i8": True}


def decode_attention_i8_ref(q: torch.Tensor, kv: PagedKV, sm_scale: float, values: bool) -> torch.Tensor:
    """q (B, HQ, D) -> (B, HQ, D) as the 8-bit kernels compute it with one split (values: the value products in 8
    bits too). A sequence's pages at once: the running maximum after each page (a cumulative maximum) sets what
    that page's probabilities are rounded against, as in the kernel's loop."""
    out = torch.empty_like(q)
    h, d = kv.k_fp.shape[1], q.shape[-1]
    scale = sm_scale * math.log2(math.e)                                             # scores in log2 units
    for b in range(q.shape[0]):
        n = int(min(kv.n_kpages[b], kv.n_vpages[b]))
        keys, vals = gather_kv(kv, b, torch.float32, skip_pages=n)                   # sink, buffers, unpaired pages
        qb = q[b].float().reshape(h, -1, d)                                         # (H, group, D)
        rest = _partial(qb @ keys.transpose(1, 2) * scale, vals)
        if n:
            s = _page_scores(qb, kv, kv.k_table[b, :n].long(), scale)              # (n, H, group, G)
            rest = _merge(rest, _page_values(s, kv, kv.v_table[b, :n].long(), values))
        o, _, l_ = rest
        out[b] = (o / l_[..., None]).reshape(q.shape[1], d).to(q.dtype)
    return out


def _page_scores(qb: torch.Tensor, kv: PagedKV, pages: torch.Tensor, scale: float) -> torch.Tensor:
    """(n, H, group, G) scores in log2 units of key pages `pages` (n,), with 8-bit query operands."""
    code = key_codes_ref(kv.k_low[pages], kv.k_high[pages], kv.k_ch[pages]).float()    # (n, H, G, D)
    k_scale, k_zero = kv.k_scale[pages].float()[:, :, None], kv.k_zero[pages].float()[:, :, None]   # (n, H, 1, D)
    qs = ((qb * Q_SCALE).half().float() * k_scale).half().float()                     # (n, H, group, D)
    low = code.remainder(4) if kv.n_boost else code
    amax = qs.abs().amax(-1)
    if kv.n_boost:
        ch = kv.k_ch[pages].long()[:, :, None]                                       # (n, H, 1, NB)
        qb_ch = torch.gather(qb.expand(len(pages), -1, -1, -1), 3, ch.expand(-1, -1, qb.shape[1], -1))
        boost = (qb_ch * (4.0 * Q_SCALE) * torch.gather(k_scale, 3, ch)).half().float()  # (n, H, group, NB)
        amax = torch.maximum(amax, boost.abs().amax(-1))
    r = (127.0 / amax.clamp(min=AMAX_FLOOR)).half().float()[..., None]              # (n, H, group, 1)
    sums = torch.round(qs * r) @ low.transpose(-1, -2)
    if kv.n_boost:
        high = torch.gather(code, 3, ch.expand(-1, -1, code.shape[2], -1)).div(4, rounding_mode="floor")
        sums = sums + torch.round(boost * r) @ high.transpose(-1, -2)
    zq = (qb * k_zero).sum(-1, keepdim=True)
    return (sums / r / Q_SCALE + zq) * scale


def _page_values(s: torch.Tensor, kv: PagedKV, pages: torch.Tensor, values: bool):
    """(output, max, sum) of value pages `pages` (n,) with scores s (n, H, group, G), each page's probabilities
    taken against the running maximum after it (the kernel's online softmax)."""
    code = value_codes_ref(kv.v_low[pages], kv.v_high[pages]).float()              # (n, H, D, G)
    v_scale, v_zero = kv.v_scale[pages].float()[:, :, None], kv.v_zero[pages].float()[:, :, None]   # (n, H, 1, G)
    page_max = s.amax(-1)                                                          # (n, H, group)
    m = page_max.cummax(0).values
    p = torch.exp2(s - m[..., None]).half().float()
    pv = (p * v_scale).half().float()
    if values:
        r = (127.0 / (v_scale.amax(-1) * torch.exp2(page_max - m))).clamp(max=65504.0).half().float()[..., None]
        pv = torch.round(pv * r) / r
    weight = torch.exp2(m - m[-1])[..., None]                                      # each page's alpha to the end
    o = (pv @ code.transpose(-1, -2) + (p * v_zero).sum(-1, keepdim=True)) * weight
    return o.sum(0), m[-1], (p.sum(-1) * weight[..., 0]).sum(0)


def _partial(s: torch.Tensor, v: torch.Tensor):
    """(output, max, sum) of exact scores s (H, group, T) over values v (H, T, D)."""
    m = s.amax(-1) if s.shape[-1] else torch.full(s.shape[:-1], float("-inf"), device=s.device)
    p = torch.exp2(s - m[..., None]) if s.shape[-1] else s
    return p @ v, m, p.sum(-1)


def _merge(a, b):
    m = torch.maximum(a[1], b[1])
    wa, wb = torch.exp2(a[1] - m), torch.exp2(b[1] - m)
    return a[0] * wa[..., None] + b[0] * wb[..., None], m, a[2] * wa + b[2] * wb
