"""The numbers of decode_attention(kernel="gluon-tma-i8k" / "gluon-tma-i8") in PyTorch: its 8-bit roundings done the
way decode_gluon.py does them, page by page in a program's order, so that a GPU test can hold the kernel to its own
arithmetic (within float tolerance) and say separately how far that arithmetic is from the exact reference.

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
from .dequantize import key_codes_ref, unpack_quarters
from .layout import PagedKV

Q_SCALE = 1.0 / 16              # decode_gluon.Q_SCALE


def decode_attention_i8_ref(q: torch.Tensor, kv: PagedKV, sm_scale: float, values: bool) -> torch.Tensor:
    """q (B, HQ, D) -> (B, HQ, D) as the 8-bit kernels compute it with one split (values: the value products in 8
    bits too)."""
    out = torch.empty_like(q)
    h, d = kv.k_fp.shape[1], q.shape[-1]
    log2e = math.log2(math.e)
    for b in range(q.shape[0]):
        keys, vals = gather_kv(kv, b, torch.float32)
        n = int(min(kv.n_kpages[b], kv.n_vpages[b]))
        sink, g = min(int(kv.seq_len[b]), kv.sink), kv.page_size
        paged = torch.zeros(keys.shape[1], dtype=torch.bool)
        paged[sink:sink + n * g] = True
        qb = q[b].float().reshape(h, -1, d)                                         # (H, group, D)
        exact = qb @ keys.transpose(1, 2) * sm_scale * log2e                         # log2 units
        rest = _partial(exact[..., ~paged], vals[:, ~paged])
        state = None
        for j in range(n):
            kp, vp = int(kv.k_table[b, j]), int(kv.v_table[b, j])
            s = _page_scores(qb, kv, kp, sm_scale * log2e)
            state = _page_values(state, s, kv, vp, values)
        o, m, l_ = _merge(rest, state)
        out[b] = (o / l_[..., None]).reshape(q.shape[1], d).to(q.dtype)
    return out


def _page_scores(qb: torch.Tensor, kv: PagedKV, page: int, scale: float) -> torch.Tensor:
    """(H, group, G) scores in log2 units of key page `page`, with 8-bit query operands."""
    code = key_codes_ref(kv.k_low[page:page + 1], kv.k_high[page:page + 1], kv.k_ch[page:page + 1])[0].float()
    k_scale, k_zero = kv.k_scale[page].float(), kv.k_zero[page].float()            # (H, D)
    qs = ((qb * Q_SCALE).half().float() * k_scale[:, None]).half().float()        # (H, group, D)
    low = code.remainder(4) if kv.n_boost else code                              # (H, G, D)
    amax = qs.abs().amax(-1)
    if kv.n_boost:
        ch = kv.k_ch[page].long()                                                # (H, NB)
        qb_ch = torch.gather(qb, 2, ch[:, None].expand(-1, qb.shape[1], -1))
        boost = (qb_ch * (4.0 * Q_SCALE) * torch.gather(k_scale, 1, ch)[:, None]).half().float()
        amax = torch.maximum(amax, boost.abs().amax(-1))
    r = (127.0 / amax.clamp(min=2.0 ** -10)).half().float()[..., None]              # (H, group, 1)
    sums = torch.round(qs * r) @ low.transpose(1, 2)
    if kv.n_boost:
        high = torch.gather(code, 2, ch[:, None].expand(-1, code.shape[1], -1)).div(4, rounding_mode="floor")
        sums = sums + torch.round(boost * r) @ high.transpose(1, 2)
    zq = (qb * k_zero[:, None]).sum(-1, keepdim=True)
    return (sums / r / Q_SCALE + zq) * scale


def _page_values(state, s: torch.Tensor, kv: PagedKV, page: int, values: bool):
    """The running (output, max, sum) after value page `page` with scores s (online softmax)."""
    code = unpack_quarters(kv.v_low[page:page + 1], dim=2)[0]                     # (H, D, G)
    if kv.v_high.shape[2]:
        code = code | unpack_quarters(kv.v_high[page:page + 1], dim=2)[0] << 2
    code = code.float()
    v_scale, v_zero = kv.v_scale[page].float(), kv.v_zero[page].float()            # (H, G)
    page_max = s.amax(-1)
    m = page_max if state is None else torch.maximum(state[1], page_max)
    p = torch.exp2(s - m[..., None]).half().float()                                # (H, group, G)
    pv = (p * v_scale[:, None]).half().float()
    if values:
        r = (127.0 / (v_scale.amax(-1)[:, None] * torch.exp2(page_max - m))).clamp(max=65504.0).half().float()
        pv = torch.round(pv * r[..., None]) / r[..., None]
    o = pv @ code.transpose(1, 2) + (p * v_zero[:, None]).sum(-1, keepdim=True)
    l_ = p.sum(-1)
    if state is not None:
        alpha = torch.exp2(state[1] - m)
        o, l_ = o + state[0] * alpha[..., None], l_ + state[2] * alpha
    return o, m, l_


def _partial(s: torch.Tensor, v: torch.Tensor):
    """(output, max, sum) of exact scores s (H, group, T) over values v (H, T, D)."""
    m = s.amax(-1) if s.shape[-1] else torch.full(s.shape[:-1], float("-inf"))
    p = torch.exp2(s - m[..., None]) if s.shape[-1] else s
    return p @ v, m, p.sum(-1)


def _merge(a, b):
    if b is None:
        return a
    m = torch.maximum(a[1], b[1])
    wa, wb = torch.exp2(a[1] - m), torch.exp2(b[1] - m)
    return a[0] * wa[..., None] + b[0] * wb[..., None], m, a[2] * wa + b[2] * wb
