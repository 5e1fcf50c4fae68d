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

"gluon-tma-i16" (limbs=True) keeps the fp16 operands of the exact kernel and splits them into two 8-bit limbs
instead of rounding them (`limbs`): per page and head, times the power of two s that takes their largest magnitude
(keys) or a bound on it (values: the page's largest p times its largest value scale, with 2^-8 to spare) into
[64, 128).
"""
from __future__ import annotations

import math

import torch

from .decode_attention import gather_kv
from .dequantize import key_codes_ref, value_codes_ref
from .layout import PagedKV

Q_SCALE = 1.0 / 16              # decode_gluon.Q_SCALE
# decode_attention's 8-bit kernels -> whether they round the value products too (decode_gluon.I8_PRODUCTS == 2). A
# cache that decodes with one of them and runs no Triton (a CPU) decodes with this module's arithmetic instead of the
# exact reference, at any shape, so that what the 8-bit products cost a real model can be measured without a GPU
# (`python -m backend.bench quality`)
I8_KERNELS = {"gluon-tma-i8k": False, "gluon-tma-i8": True, "gluon-tma-i16": True}
LIMB_KERNELS = ("gluon-tma-i16",)          # ... of which those whose operands are split into limbs, not rounded
LIMB_HI = 1.0 - 2.0 ** -8                  # decode_gluon.I16_HI


def limb_scale(amax: torch.Tensor) -> torch.Tensor:
    """decode_gluon._limb_scale: the power of two that takes amax (at least 2^-9) into [64, 128)."""
    _, e = torch.frexp(amax.float().clamp(min=2.0 ** -9))                          # amax = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), 7 - e)


def limbs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_gluon.I16_ROUND_ASM on v = x * s (x fp16, s a power of two, |v| < 128), in float32 (exact here: 11-bit
    v times a 9-bit factor, and v - hi): hi = round(LIMB_HI * v), lo = round(128 * (v - hi)), both in [-127, 127];
    hi + lo / 128 is v wherever |v| >= 8, and within 2^-8 of it elsewhere."""
    hi = torch.round(v * LIMB_HI)
    return hi, torch.round((v - hi) * 128.0)


def _integers(v: torch.Tensor) -> torch.Tensor:
    """v's two limbs as one integer in lo's units: 128 * hi + lo (exact in float32)."""
    hi, lo = limbs(v)
    return hi * 128.0 + lo


def decode_attention_i8_ref(q: torch.Tensor, kv: PagedKV, sm_scale: float, values: bool,
                            limbs: bool = False) -> torch.Tensor:
    """q (B, HQ, D) -> (B, HQ, D) as the 8-bit kernels compute it with one split (values: the value products in 8
    bits too; limbs: the operands in two limbs, "gluon-tma-i16"). A sequence's pages at once: the running maximum
    after each page (a cumulative maximum) sets what that page's probabilities are rounded against, as in the
    kernel's loop."""
    out = torch.empty_like(q)
    h, d = kv.k_fp.shape[1], q.shape[-1]
    scale = sm_scale * math.log2(math.e)                                             # scores in log2 units
    for b in range(q.shape[0]):
        n = int(min(kv.n_kpages[b], kv.n_vpages[b]))
        keys, vals = gather_kv(kv, b, torch.float32, skip_pages=n)                   # sink, buffers, unpaired pages
        qb = q[b].float().reshape(h, -1, d)                                         # (H, group, D)
        rest = _partial(qb @ keys.transpose(1, 2) * scale, vals)
        if n:
            s = _page_scores(qb, kv, kv.k_table[b, :n].long(), scale, limbs)      # (n, H, group, G)
            rest = _merge(rest, _page_values(s, kv, kv.v_table[b, :n].long(), values, limbs))
        o, _, l_ = rest
        out[b] = (o / l_[..., None]).reshape(q.shape[1], d).to(q.dtype)
    return out


def _page_scores(qb: torch.Tensor, kv: PagedKV, pages: torch.Tensor, scale: float, split: bool) -> torch.Tensor:
    """(n, H, group, G) scores in log2 units of key pages `pages` (n,), with 8-bit query operands (split: in two
    limbs)."""
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
    # the operands as integers (in lo's units, for limbs: 128 * hi + lo) and what divides their sums
    if split:
        s = limb_scale(amax)[..., None]                                              # (n, H, group, 1)
        integers, r = lambda x: _integers(x * s), s * 128.0                           # noqa: E731
    else:
        r = (127.0 / amax.clamp(min=2.0 ** -10)).half().float()[..., None]
        integers = lambda x: torch.round(x * r)                                      # noqa: E731
    sums = integers(qs) @ low.transpose(-1, -2)
    if kv.n_boost:
        high = torch.gather(code, 3, ch.expand(-1, -1, code.shape[2], -1)).div(4, rounding_mode="floor")
        sums = sums + integers(boost) @ high.transpose(-1, -2)
    zq = (qb * k_zero).sum(-1, keepdim=True)
    return (sums / r / Q_SCALE + zq) * scale


def _page_values(s: torch.Tensor, kv: PagedKV, pages: torch.Tensor, values: bool, split: bool):
    """(output, max, sum) of value pages `pages` (n,) with scores s (n, H, group, G), each page's probabilities
    taken against the running maximum after it (the kernel's online softmax); values: p * scale rounded to 8 bits
    (split: in two limbs)."""
    code = value_codes_ref(kv.v_low[pages], kv.v_high[pages]).float()              # (n, H, D, G)
    v_scale, v_zero = kv.v_scale[pages].float()[:, :, None], kv.v_zero[pages].float()[:, :, None]   # (n, H, 1, G)
    page_max = s.amax(-1)                                                          # (n, H, group)
    m = page_max.cummax(0).values
    p = torch.exp2(s - m[..., None]).half().float()
    pv = (p * v_scale).half().float()
    if values and split:
        r = limb_scale(v_scale.amax(-1) * torch.exp2(page_max - m) * (1.0 + 2.0 ** -8))[..., None] * 128.0
        pv = _integers(pv * r / 128.0) / r
    elif values:
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
