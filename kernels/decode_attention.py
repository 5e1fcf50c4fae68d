"""Decode attention of one new query per sequence over [sink | key/value pages | key Q-buffer | value tail].

Flash-decoding: each (sequence, KV head) gets NSPLIT programs that share its blocks where both a key page and a
value page exist (a loop without branches, which Triton software-pipelines), plus one program per remaining
block (the sink, a key page whose values are still in the window, the buffers). Each runs an online softmax with
all query heads of the KV group in the rows of one tile and writes a partial (max, sum, output); a small second
kernel merges them with log-sum-exp weights. No score tensor and no full-precision copy of the cache reach memory.

Dequantization is folded into the two products (exact algebra):
    q . k_t = sum_d (q_d * scale_d) * code_dt + sum_d q_d * zero_d           (keys: per-channel scale / zero)
    sum_t p_t v_t = sum_t (p_t * scale_t) * code_t + sum_t p_t * zero_t      (values: per-token scale / zero)
so the integer codes themselves are the matrix operands. The page layout (layout.py) keeps each product's
contracted dimension contiguous and puts a byte's four 2-bit fields in four quarters of the other dimension:
a 32-bit word of page data holds 4 contracted elements of each of 4 quarters, already in the order the matrix
units read them, and becomes 16 operand values with bit operations (`_quarters`): no shifting of tiles between
threads. Keys give scores by token quarter, values accumulate by channel quarter.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .dequantize import dequantize_keys_ref, dequantize_values_ref
from .layout import PagedKV


# ---------------------------------------------------------------------------------------------- reference
def gather_kv(kv: PagedKV, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values in token order, (H, L, D) each, pages dequantized (the reference path)."""
    s, g = kv.sink, kv.page_size
    length, nkp, nvp = (int(x[b]) for x in (kv.seq_len, kv.n_kpages, kv.n_vpages))
    sink = min(length, s)
    kp, vp = kv.k_table[b, :nkp].long(), kv.v_table[b, :nvp].long()
    k_pages = dequantize_keys_ref(kv.k_low[kp], kv.k_high[kp], kv.k_ch[kp], kv.k_scale[kp], kv.k_zero[kp], dtype)
    v_pages = dequantize_values_ref(kv.v_low[vp], kv.v_high[vp], kv.v_scale[vp], kv.v_zero[vp], dtype)
    h, d = kv.k_fp.shape[1], kv.k_fp.shape[3]
    keys = torch.cat([kv.k_fp[b, :, :sink].to(dtype), k_pages.transpose(0, 1).reshape(h, nkp * g, d),
                      kv.k_fp[b, :, s:s + length - sink - nkp * g].to(dtype)], dim=1)
    values = torch.cat([kv.v_fp[b, :, :sink].to(dtype), v_pages.transpose(0, 1).reshape(h, nvp * g, d),
                        kv.v_fp[b, :, s:s + length - sink - nvp * g].to(dtype)], dim=1)
    return keys, values


def decode_attention_ref(q: torch.Tensor, kv: PagedKV, sm_scale: float) -> torch.Tensor:
    """q (B, HQ, D) -> (B, HQ, D): softmax(q K^T * sm_scale) V per sequence, in float32, cast to q's dtype."""
    out = torch.empty_like(q)
    h = kv.k_fp.shape[1]
    for b in range(q.shape[0]):
        keys, values = gather_kv(kv, b, torch.float32)
        qb = q[b].float().reshape(h, -1, q.shape[-1])                            # (H, group, D)
        p = torch.softmax(qb @ keys.transpose(1, 2) * sm_scale, dim=-1)
        out[b] = (p @ values).reshape(q.shape[1], -1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------- Triton
# 2-bit fields -> 16-bit operands with bit operations (the lop3 trick of Marlin / BitDecoding). A 32-bit word holds
# four bytes b0..b3 (4 consecutive elements of the contracted dimension); prmt reorders them (b0, b2, b1, b3) so
# that the low byte of each 16-bit half is b0 / b1, or b2 / b3 after >> 8. OR-ing the field at bits 2i into the
# mantissa of a "magic" float M (bf16 128, fp16 1024: spacing 1 there) gives M + w * code with w = 4^i; one fused
# multiply-add per pair, (M + w * code) / w - M / w, returns the code exactly. bf16 has 7 mantissa bits, so its
# fourth field (bits 6-7) is shifted down first (w = 1). With offset=True the fma is left out and the operand stays
# M + w * code; the kernel takes M and w out of the products' sums instead (decode_tokens_m's "tokens-m-offset").
# For heads-m that was measured no faster on the H200, and less accurate for fp16 (BENCHMARKS.md).
MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}
FIELDS_IN_MANTISSA = {torch.bfloat16: 3, torch.float16: 4}


def _bits16(value: float, dtype: torch.dtype) -> int:
    """A 32-bit word holding `value` in both 16-bit halves."""
    half = torch.tensor([value], dtype=dtype).view(torch.int16).item() & 0xFFFF
    return half | half << 16


def field_weights(dtype: torch.dtype) -> list[float]:
    """w of each quarter's operand M + w * code in unpack_asm(dtype, offset=True)."""
    return [4.0 ** (i if i < FIELDS_IN_MANTISSA[dtype] else 0) for i in range(4)]


def unpack_asm(dtype: torch.dtype, offset: bool = False) -> str:
    """PTX: one word of 4 bytes ($8) -> for each quarter i, the 16-bit pairs of field i of bytes (0, 1) in $2i and
    of bytes (2, 3) in $2i+1, as exact values 0..3 of `dtype` (offset=True: as M + w_i * code, field_weights)."""
    magic = MAGIC[dtype]
    fma = {torch.bfloat16: "fma.rn.bf16x2", torch.float16: "fma.rn.f16x2"}[dtype]
    lines = ["{ .reg .b32 t, u, v, s, o;", "prmt.b32 t, $8, 0, 0x3120;", "shr.b32 u, t, 8;"]
    for i, weight in enumerate(field_weights(dtype)):
        shift = 2 * i                                 # where field i sits; fields past the mantissa move down
        if i >= FIELDS_IN_MANTISSA[dtype]:
            lines += [f"shr.b32 t, t, {shift};", f"shr.b32 u, u, {shift};"]
            shift = 0
        if not offset:
            lines += [f"mov.b32 s, {_bits16(1.0 / weight, dtype):#x};",
                      f"mov.b32 o, {_bits16(-magic / weight, dtype):#x};"]
        for k, word in enumerate("tu"):
            mask = f"{0x00030003 << shift:#x}, {_bits16(magic, dtype):#x}, 0xea;"
            if offset:
                lines += [f"lop3.b32 ${2 * i + k}, {word}, {mask}"]
            else:
                lines += [f"lop3.b32 v, {word}, {mask}", f"{fma} ${2 * i + k}, v, s, o;"]
    return " ".join(lines) + " }"


UNPACK_BF16 = tl.constexpr(unpack_asm(torch.bfloat16))
UNPACK_FP16 = tl.constexpr(unpack_asm(torch.float16))
UNPACK_BF16_OFFSET = tl.constexpr(unpack_asm(torch.bfloat16, offset=True))
# the bf16 operands of the offset unpacking: M + w_i * code (field_weights(torch.bfloat16) = 1, 4, 16, 1)
OFFSET_MAGIC = tl.constexpr(MAGIC[torch.bfloat16])
OFFSET_W1 = tl.constexpr(4.0)
OFFSET_W2 = tl.constexpr(16.0)


@triton.jit
def _quarters(x, DOT: tl.constexpr, ASM: tl.constexpr):
    """A uint8 tile -> its four 2-bit fields as DOT tiles, quarter i = bits 2i. ASM 1 / 2 (compiled, bf16 / fp16
    operands): the bit trick above, 4 bytes per 32-bit word; 0 (any dtype, the interpreter): shifts and
    conversions."""
    if ASM == 1:
        return tl.inline_asm_elementwise(asm=UNPACK_BF16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=4)
    if ASM == 2:
        return tl.inline_asm_elementwise(asm=UNPACK_FP16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                         pack=4)
    w = x.to(tl.int32)
    return (w & 3).to(DOT), ((w >> 2) & 3).to(DOT), ((w >> 4) & 3).to(DOT), ((w >> 6) & 3).to(DOT)


@triton.jit
def _quarters_offset(x, DOT: tl.constexpr, ASM: tl.constexpr):
    """_quarters for bf16 queries, without the last step: quarter i as OFFSET_MAGIC + w_i * code, w = 1, OFFSET_W1,
    OFFSET_W2, 1 (ASM 1: one lop3 per pair; the interpreter computes the same values in DOT, exactly)."""
    if ASM == 1:
        return tl.inline_asm_elementwise(asm=UNPACK_BF16_OFFSET, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=4)
    w = x.to(tl.int32)
    return ((w & 3).to(DOT) + OFFSET_MAGIC, ((w >> 2) & 3).to(DOT) * OFFSET_W1 + OFFSET_MAGIC,
            ((w >> 4) & 3).to(DOT) * OFFSET_W2 + OFFSET_MAGIC, ((w >> 6) & 3).to(DOT) + OFFSET_MAGIC)


KC = tl.constexpr(32)        # channels per key chunk: keeps one chunk's four unpacked quarters in registers


@triton.jit
def _key_page_scores(q_rows, rmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, page,
                     D: tl.constexpr, G4: tl.constexpr, NB: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                     ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_NB: tl.constexpr):
    """Scores in log2 units (qk_scale = sm_scale * log2 e applied) of the 4 token quarters of key page `page`
    (= page id * H + head), read KC channels at a time. q_rows: (BLOCK_M,) pointers to the query rows, rmask:
    the real ones."""
    j = tl.arange(0, BLOCK_G4)
    jmask = (j < G4)[None, :]
    s0 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s1 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s3 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    zq = tl.zeros((BLOCK_M,), tl.float32)
    for chunk in tl.static_range(0, D, KC):
        d = chunk + tl.arange(0, KC)
        dmask = d < D
        q = tl.load(q_rows[:, None] + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        q = q * qk_scale
        scale = tl.load(kscale_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)
        zero = tl.load(kzero_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)
        zq += tl.sum(q * zero[None, :], axis=1)
        a = (q * scale[None, :]).to(DOT)
        tile = tl.load(klow_ptr + page * (G4 * D) + j[None, :] * D + d[:, None], mask=dmask[:, None] & jmask,
                       other=0)                                                 # (channel, token-in-quarter)
        k0, k1, k2, k3 = _quarters(tile, DOT, ASM)
        s0 = tl.dot(a, k0, s0, input_precision=PREC)
        s1 = tl.dot(a, k1, s1, input_precision=PREC)
        s2 = tl.dot(a, k2, s2, input_precision=PREC)
        s3 = tl.dot(a, k3, s3, input_precision=PREC)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        r = tl.arange(0, BLOCK_NB)
        nbmask = r < NB
        ch = tl.load(kch_ptr + page * NB + r, mask=nbmask, other=0).to(tl.int32)
        ch_scale = tl.load(kscale_ptr + page * D + ch, mask=nbmask, other=0.0).to(tl.float32)
        q_ch = tl.load(q_rows[:, None] + ch[None, :], mask=rmask[:, None] & nbmask[None, :], other=0.0)
        a = (q_ch.to(tl.float32) * qk_scale * (4.0 * ch_scale)[None, :]).to(DOT)
        tile = tl.load(khigh_ptr + page * (G4 * NB) + j[None, :] * NB + r[:, None], mask=nbmask[:, None] & jmask,
                       other=0)
        h0, h1, h2, h3 = _quarters(tile, DOT, ASM)
        s0 = tl.dot(a, h0, s0, input_precision=PREC)
        s1 = tl.dot(a, h1, s1, input_precision=PREC)
        s2 = tl.dot(a, h2, s2, input_precision=PREC)
        s3 = tl.dot(a, h3, s3, input_precision=PREC)
    zq = zq[:, None]
    return s0 + zq, s1 + zq, s2 + zq, s3 + zq


@triton.jit
def _fp_key_scores(q_rows, rmask, qk_scale, kfp_ptr, row0, n_valid, D: tl.constexpr, G4: tl.constexpr,
                   DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr):
    """Scores in log2 units of the 4 token quarters of up to 4*G4 full-precision keys from row `row0` of k_fp."""
    j = tl.arange(0, BLOCK_G4)
    s0 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s1 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s2 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    s3 = tl.zeros((BLOCK_M, BLOCK_G4), tl.float32)
    for chunk in tl.static_range(0, D, KC):
        d = chunk + tl.arange(0, KC)
        dmask = d < D
        q = tl.load(q_rows[:, None] + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT)
        ptrs = kfp_ptr + (row0 + j[None, :]).to(tl.int64) * D + d[:, None]
        mask = dmask[:, None] & (j < G4)[None, :]
        s0 = tl.dot(q, tl.load(ptrs, mask=mask & (j < n_valid)[None, :], other=0.0).to(DOT), s0,
                    input_precision=PREC)
        s1 = tl.dot(q, tl.load(ptrs + G4 * D, mask=mask & (G4 + j < n_valid)[None, :], other=0.0).to(DOT), s1,
                    input_precision=PREC)
        s2 = tl.dot(q, tl.load(ptrs + 2 * G4 * D, mask=mask & (2 * G4 + j < n_valid)[None, :], other=0.0).to(DOT),
                    s2, input_precision=PREC)
        s3 = tl.dot(q, tl.load(ptrs + 3 * G4 * D, mask=mask & (3 * G4 + j < n_valid)[None, :], other=0.0).to(DOT),
                    s3, input_precision=PREC)
    return s0, s1, s2, s3


@triton.jit
def _online_softmax(s0, s1, s2, s3, n_valid, m_i, l_i, G4: tl.constexpr, BLOCK_G4: tl.constexpr,
                    MASKED: tl.constexpr):
    """Mask the 4 quarters' scores (log2 units; with MASKED, tokens >= n_valid are out), update the running max
    and sum. Returns the probabilities, the factor the running output must be multiplied by, the new max / sum."""
    if MASKED:
        j = tl.arange(0, BLOCK_G4)
        jmask = (j < G4)[None, :]
        s0 = tl.where(jmask & (j < n_valid)[None, :], s0, float("-inf"))
        s1 = tl.where(jmask & (G4 + j < n_valid)[None, :], s1, float("-inf"))
        s2 = tl.where(jmask & (2 * G4 + j < n_valid)[None, :], s2, float("-inf"))
        s3 = tl.where(jmask & (3 * G4 + j < n_valid)[None, :], s3, float("-inf"))
    m_new = tl.maximum(tl.maximum(tl.maximum(m_i, tl.max(s0, axis=1)), tl.max(s1, axis=1)),
                       tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1)))
    alpha = tl.math.exp2(m_i - m_new)
    p0 = tl.math.exp2(s0 - m_new[:, None])
    p1 = tl.math.exp2(s1 - m_new[:, None])
    p2 = tl.math.exp2(s2 - m_new[:, None])
    p3 = tl.math.exp2(s3 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p0, axis=1) + tl.sum(p1, axis=1) + tl.sum(p2, axis=1) + tl.sum(p3, axis=1)
    return p0, p1, p2, p3, alpha, m_new, l_i


@triton.jit
def _value_quarter(p, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, page,
                   quarter: tl.constexpr, G: tl.constexpr, D4: tl.constexpr, V_BITS: tl.constexpr,
                   DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
                   BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr):
    """Accumulate token quarter `quarter` of value page `page`: the 4 channel quarters into acc0..acc3 and the
    zero-point term sum_t p_t * zero_t into zacc."""
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    c = tl.arange(0, BLOCK_D4)
    tok = quarter * G4 + j
    jmask = j < G4
    vscale = tl.load(vscale_ptr + page * G + tok, mask=jmask, other=0.0).to(tl.float32)
    vzero = tl.load(vzero_ptr + page * G + tok, mask=jmask, other=0.0).to(tl.float32)
    zacc += tl.sum(p * vzero[None, :], axis=1)
    a = (p * vscale[None, :]).to(DOT)
    offs = page * (D4 * G) + c[None, :] * G + tok[:, None]                    # (token, channel byte), tokens contiguous
    mask = jmask[:, None] & (c < D4)[None, :]
    v0, v1, v2, v3 = _quarters(tl.load(vlow_ptr + offs, mask=mask, other=0), DOT, ASM)
    acc0 = tl.dot(a, v0, acc0, input_precision=PREC)
    acc1 = tl.dot(a, v1, acc1, input_precision=PREC)
    acc2 = tl.dot(a, v2, acc2, input_precision=PREC)
    acc3 = tl.dot(a, v3, acc3, input_precision=PREC)
    if V_BITS == 4:
        a = (a.to(tl.float32) * 4.0).to(DOT)                                   # exact: the high bits weigh 4
        v0, v1, v2, v3 = _quarters(tl.load(vhigh_ptr + offs, mask=mask, other=0), DOT, ASM)
        acc0 = tl.dot(a, v0, acc0, input_precision=PREC)
        acc1 = tl.dot(a, v1, acc1, input_precision=PREC)
        acc2 = tl.dot(a, v2, acc2, input_precision=PREC)
        acc3 = tl.dot(a, v3, acc3, input_precision=PREC)
    return acc0, acc1, acc2, acc3, zacc


@triton.jit
def _fp_value_quarter(p, acc0, acc1, acc2, acc3, vfp_ptr, row0, n_valid, quarter: tl.constexpr, D: tl.constexpr,
                      G4: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_G4: tl.constexpr,
                      BLOCK_D4: tl.constexpr):
    """Accumulate token quarter `quarter` of up to 4*G4 full-precision values from row `row0` of v_fp."""
    D4: tl.constexpr = D // 4
    j = tl.arange(0, BLOCK_G4)
    c = tl.arange(0, BLOCK_D4)
    tok = quarter * G4 + j
    ptrs = vfp_ptr + (row0 + tok[:, None]).to(tl.int64) * D + c[None, :]
    mask = ((tok < n_valid) & (j < G4))[:, None] & (c < D4)[None, :]
    pd = p.to(DOT)
    acc0 = tl.dot(pd, tl.load(ptrs, mask=mask, other=0.0).to(DOT), acc0, input_precision=PREC)
    acc1 = tl.dot(pd, tl.load(ptrs + D4, mask=mask, other=0.0).to(DOT), acc1, input_precision=PREC)
    acc2 = tl.dot(pd, tl.load(ptrs + 2 * D4, mask=mask, other=0.0).to(DOT), acc2, input_precision=PREC)
    acc3 = tl.dot(pd, tl.load(ptrs + 3 * D4, mask=mask, other=0.0).to(DOT), acc3, input_precision=PREC)
    return acc0, acc1, acc2, acc3


@triton.jit
def _paged_block(q_rows, rmask, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, zacc, kpage, vpage,
                 klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
                 D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr,
                 BLOCK_D4: tl.constexpr, BLOCK_NB: tl.constexpr):
    """One block whose keys and values are both pages: scores, online softmax, values."""
    G4: tl.constexpr = G // 4
    s0, s1, s2, s3 = _key_page_scores(q_rows, rmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                      kzero_ptr, kpage, D, G4, NB, DOT, PREC, ASM, BLOCK_M, BLOCK_G4, BLOCK_NB)
    p0, p1, p2, p3, alpha, m_i, l_i = _online_softmax(s0, s1, s2, s3, G, m_i, l_i, G4, BLOCK_G4, BLOCK_G4 != G4)
    acc0, acc1, acc2, acc3 = acc0 * alpha[:, None], acc1 * alpha[:, None], acc2 * alpha[:, None], acc3 * alpha[:, None]
    zacc = zacc * alpha
    acc0, acc1, acc2, acc3, zacc = _value_quarter(p0, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr, vscale_ptr,
                                                  vzero_ptr, vpage, 0, G, D // 4, V_BITS, DOT, PREC, ASM,
                                                  BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc = _value_quarter(p1, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr, vscale_ptr,
                                                  vzero_ptr, vpage, 1, G, D // 4, V_BITS, DOT, PREC, ASM,
                                                  BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc = _value_quarter(p2, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr, vscale_ptr,
                                                  vzero_ptr, vpage, 2, G, D // 4, V_BITS, DOT, PREC, ASM,
                                                  BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc = _value_quarter(p3, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr, vscale_ptr,
                                                  vzero_ptr, vpage, 3, G, D // 4, V_BITS, DOT, PREC, ASM,
                                                  BLOCK_G4, BLOCK_D4)
    return m_i, l_i, acc0, acc1, acc2, acc3, zacc


@triton.jit
def _program_blocks(seqlen_ptr, nkp_ptr, nvp_ptr, b, part, NSPLIT, S: tl.constexpr, G: tl.constexpr):
    """Which blocks of sequence b program `part` reads: paged slots [start, end) when part < NSPLIT (the blocks
    with a key page and a value page, shared evenly), else remaining block `rest` < n_rest (the sink's blocks,
    then the G-token slots after the paged ones: a key page with full-precision values, the buffers)."""
    length = tl.load(seqlen_ptr + b)
    nkp = tl.load(nkp_ptr + b)
    nvp = tl.load(nvp_ptr + b)
    n_paged = tl.minimum(nkp, nvp)
    per_split = tl.cdiv(n_paged, NSPLIT)
    start = tl.where(part < NSPLIT, part * per_split, 0)
    end = tl.where(part < NSPLIT, tl.minimum(start + per_split, n_paged), 0)
    sink_len = tl.minimum(length, S)
    n_sink_blocks = tl.cdiv(sink_len, G)
    n_rest = n_sink_blocks + tl.cdiv(length - sink_len, G) - n_paged
    rest = tl.where(part >= NSPLIT, part - NSPLIT, n_rest)
    return start, end, rest, n_rest, n_sink_blocks, sink_len, n_paged, length, nkp, nvp


# Sizes that grow during generation are not specialized on (Triton would compile a new variant whenever one
# becomes a multiple of 16, stalling a decode step for a second or more).
@triton.jit(do_not_specialize=["CK", "CV", "KMP", "VMP", "NSPLIT", "NPART"])
def _decode_split_kernel(
        q_ptr, kfp_ptr, vfp_ptr,
        klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, seqlen_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, CK, CV, KMP, VMP, NSPLIT, NPART,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        NB: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr, BLOCK_NB: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)         # < NSPLIT: a share of the paged blocks; else remaining block part - NSPLIT
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    start, end, rest, n_rest, n_sink_blocks, sink_len, n_paged, length, nkp, nvp = _program_blocks(
        seqlen_ptr, nkp_ptr, nvp_ptr, b, part, NSPLIT, S, G)

    rows = tl.arange(0, BLOCK_M)
    rmask = rows < GROUP
    q_rows = q_ptr + (b * H * GROUP + h * GROUP + rows).to(tl.int64) * D
    kv_head = (b * H + h).to(tl.int64)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    zacc = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, BLOCK_D4), tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_D4), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_D4), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_D4), tl.float32)

    for slot in range(start, end):                      # both pages quantized: no branch in the loop body
        kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
        vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
        m_i, l_i, acc0, acc1, acc2, acc3, zacc = _paged_block(
            q_rows, rmask, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, zacc, kpage, vpage, klow_ptr, khigh_ptr,
            kch_ptr, kscale_ptr, kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, D, G, NB, V_BITS, DOT, PREC,
            ASM, BLOCK_M, BLOCK_G4, BLOCK_D4, BLOCK_NB)

    for blk in range(rest, tl.minimum(rest + 1, n_rest)):   # at most one remaining block per program
        in_sink = blk < n_sink_blocks
        slot = blk - n_sink_blocks + n_paged
        n_valid = tl.where(in_sink, sink_len - blk * G, tl.minimum(G, length - S - slot * G))
        if (blk >= n_sink_blocks) & (slot < nkp):
            kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
            s0, s1, s2, s3 = _key_page_scores(q_rows, rmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                              kzero_ptr, kpage, D, G4, NB, DOT, PREC, ASM, BLOCK_M, BLOCK_G4,
                                              BLOCK_NB)
        else:
            row0 = tl.where(in_sink, blk * G, S + (slot - nkp) * G)
            s0, s1, s2, s3 = _fp_key_scores(q_rows, rmask, qk_scale, kfp_ptr + kv_head * CK * D, row0, n_valid, D,
                                            G4, DOT, PREC, BLOCK_M, BLOCK_G4)
        p0, p1, p2, p3, alpha, m_i, l_i = _online_softmax(s0, s1, s2, s3, n_valid, m_i, l_i, G4, BLOCK_G4, True)
        if (blk >= n_sink_blocks) & (slot < nvp):
            vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
            acc0, acc1, acc2, acc3, zacc = _value_quarter(p0, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 0, G, D4, V_BITS, DOT,
                                                          PREC, ASM, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3, zacc = _value_quarter(p1, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 1, G, D4, V_BITS, DOT,
                                                          PREC, ASM, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3, zacc = _value_quarter(p2, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 2, G, D4, V_BITS, DOT,
                                                          PREC, ASM, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3, zacc = _value_quarter(p3, acc0, acc1, acc2, acc3, zacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 3, G, D4, V_BITS, DOT,
                                                          PREC, ASM, BLOCK_G4, BLOCK_D4)
        else:
            row0 = tl.where(in_sink, blk * G, S + (slot - nvp) * G)
            vfp = vfp_ptr + kv_head * CV * D
            acc0, acc1, acc2, acc3 = _fp_value_quarter(p0, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 0, D, G4, DOT,
                                                       PREC, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter(p1, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 1, D, G4, DOT,
                                                       PREC, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter(p2, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 2, D, G4, DOT,
                                                       PREC, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter(p3, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 3, D, G4, DOT,
                                                       PREC, BLOCK_G4, BLOCK_D4)

    idx = (b * H * GROUP + h * GROUP + rows).to(tl.int64) * NPART + part
    tl.store(pm_ptr + idx, m_i, mask=rmask)
    tl.store(pl_ptr + idx, l_i, mask=rmask)
    c = tl.arange(0, BLOCK_D4)
    out = po_ptr + idx[:, None] * D + c[None, :]
    omask = rmask[:, None] & (c < D4)[None, :]
    tl.store(out, acc0 + zacc[:, None], mask=omask)
    tl.store(out + D4, acc1 + zacc[:, None], mask=omask)
    tl.store(out + 2 * D4, acc2 + zacc[:, None], mask=omask)
    tl.store(out + 3 * D4, acc3 + zacc[:, None], mask=omask)


@triton.jit(do_not_specialize=["NPART"])
def _merge_splits_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, NPART, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                 # one (sequence, query head)
    d = tl.arange(0, BLOCK_D)
    m_max = float("-inf")
    for first in range(0, NPART, BLOCK_S):
        sp = first + tl.arange(0, BLOCK_S)
        m_max = tl.maximum(m_max, tl.max(tl.load(pm_ptr + row * NPART + sp, mask=sp < NPART, other=float("-inf")), 0))
    num = tl.zeros((BLOCK_D,), tl.float32)
    den = 0.0
    for first in range(0, NPART, BLOCK_S):
        sp = first + tl.arange(0, BLOCK_S)
        smask = sp < NPART
        m = tl.load(pm_ptr + row * NPART + sp, mask=smask, other=float("-inf"))
        w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)      # empty parts (m = -inf) weigh 0
        den += tl.sum(tl.load(pl_ptr + row * NPART + sp, mask=smask, other=0.0) * w, 0)
        o = tl.load(po_ptr + (row * NPART + sp[:, None]) * D + d[None, :], mask=smask[:, None] & (d < D)[None, :],
                    other=0.0)
        num += tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + row * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=d < D)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype):
    """Operand type of the matrix products: the model's half type on a GPU. Triton's CPU interpreter computes
    bfloat16 arithmetic wrongly (numpy has no bfloat16), so interpreted bfloat16 runs use float32 operands."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreted():
        return tl.bfloat16
    return tl.float32


REGISTERS_PER_SM = 65536      # 32-bit registers of an H100 / H200 multiprocessor (what bounds resident programs here)
MIN_PAGES_PER_SPLIT = 4       # below this, a program's set-up outweighs its share of pages (unless all fit one wave)


def resident_programs(maxnreg: int, num_warps: int = 1) -> int:
    """Programs of the decode kernel resident on one multiprocessor at `maxnreg` registers per thread: 8 one-warp
    programs at the compiler's 255, 16 at a cap of 128."""
    return REGISTERS_PER_SM // (32 * num_warps * maxnreg)


def default_splits(batch: int, kv_heads: int, max_pages: int, sm_count: int = 132, resident: int = 8) -> int:
    """Programs over the paged blocks per (sequence, KV head), in whole waves of `resident` programs per
    multiprocessor (a wave that is a few programs over costs a whole second wave): one page each when that fits
    one wave, else two waves for small batches and one for large ones, with at least MIN_PAGES_PER_SPLIT pages
    each. Fitted to the H200 sweeps in BENCHMARKS.md (`python -m backend.bench tune`)."""
    wave = resident * sm_count
    pairs = batch * kv_heads
    if pairs * max_pages <= wave:
        return max(1, max_pages)
    waves = 2 if pairs <= 64 else 1
    return max(1, min(waves * wave // pairs, triton.cdiv(max_pages, MIN_PAGES_PER_SPLIT), 256))


def remaining_blocks(kv: PagedKV) -> int:
    """An upper bound (from sizes the host knows) on the blocks of a sequence that are not paged on both sides:
    the sink's, and the full-precision buffers' (key Q-buffer; value Q-buffer and window; all of a 16-bit side)."""
    g, s = kv.page_size, kv.sink
    return triton.cdiv(s, g) + triton.cdiv(max(kv.k_fp.shape[2], kv.v_fp.shape[2]) - s, g) + 1


class DecodeWorkspace:
    """decode_attention's partial results and output, kept between calls of one layer so that a decode step
    allocates nothing (and a captured CUDA graph keeps its addresses). The output returned by a call is
    overwritten by the next call with the same workspace."""

    def __init__(self):
        self.buffers: tuple[torch.Tensor, ...] = ()

    def get(self, q: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, ...]:
        bsz, hq, d = q.shape
        out = self.buffers[3] if self.buffers else None
        if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
                or self.buffers[1].shape[2] != num_parts:
            part_o = torch.empty((bsz, hq, num_parts, d), dtype=torch.float32, device=q.device)
            part_m = torch.empty((bsz, hq, num_parts), dtype=torch.float32, device=q.device)
            self.buffers = (part_o, part_m, torch.empty_like(part_m), torch.empty_like(q))
        return self.buffers


# Which decode kernel (decode_attention's `kernel`): query heads on the rows of the matrix products (this module's
# _decode_split_kernel) or tokens / channels on the rows (decode_tokens_m.py); "tokens-m-offset" (the default,
# fastest at every shape measured on the H200) also leaves bf16 code operands as M + w * code (_quarters_offset;
# fp16 runs as "tokens-m"). Each kernel's register cap per thread: the fastest measured (BENCHMARKS.md section 1);
# tokens-m's spills a little at 128, and its 16 resident programs per multiprocessor more than pay for that.
DECODE_KERNELS = ("heads-m", "tokens-m", "tokens-m-offset")
DEFAULT_KERNEL = "tokens-m-offset"
KERNEL_MAXNREG = {"heads-m": 255, "tokens-m": 128, "tokens-m-offset": 128}


def split_kernel(kernel: str = DEFAULT_KERNEL):
    """The Triton kernel named `kernel` (one of DECODE_KERNELS); both take split_kernel_arguments."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r} must be one of {DECODE_KERNELS}")
    if kernel.startswith("tokens-m"):
        from .decode_tokens_m import _decode_tokens_m_kernel      # imports this module's helpers: no cycle at load
        return _decode_tokens_m_kernel
    return _decode_split_kernel


def split_kernel_arguments(q, kv: PagedKV, sm_scale: float, parts, num_splits: int,
                           kernel: str = DEFAULT_KERNEL) -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of split_kernel(kernel) for one launch; parts are the
    (output, max, sum) partials: num_splits programs over the paged blocks, the rest one remaining block each.
    Also used to compile the kernel for a profile. BLOCK_M is the group's query heads padded to a matrix side:
    16 rows for heads-m, 8 columns (the instruction's n8) for tokens-m."""
    part_o, part_m, part_l = parts
    bsz, hq, d = q.shape
    h, g = kv.k_fp.shape[1], kv.page_size
    args = (q, kv.k_fp, kv.v_fp, kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero,
            kv.v_low, kv.v_high, kv.v_scale, kv.v_zero, kv.k_table, kv.v_table, kv.seq_len, kv.n_kpages,
            kv.n_vpages, part_o, part_m, part_l, sm_scale * math.log2(math.e), kv.k_fp.shape[2], kv.v_fp.shape[2],
            kv.k_table.shape[1], kv.v_table.shape[1], num_splits, part_m.shape[2])
    dot = dot_dtype(q.dtype)
    constants = dict(H=h, GROUP=hq // h, D=d, S=kv.sink, G=g, NB=kv.n_boost, V_BITS=kv.v_bits, DOT=dot,
                     PREC="ieee" if dot == tl.float32 else "tf32",
                     ASM=0 if interpreted() else {tl.bfloat16: 1, tl.float16: 2}.get(dot, 0),
                     BLOCK_M=max(16 if kernel == "heads-m" else 8, triton.next_power_of_2(hq // h)),
                     BLOCK_G4=max(16, triton.next_power_of_2(g // 4)), BLOCK_D4=max(16, triton.next_power_of_2(d // 4)),
                     BLOCK_NB=max(16, triton.next_power_of_2(kv.n_boost)))
    if kernel.startswith("tokens-m"):
        constants["OFFSET"] = kernel == "tokens-m-offset" and q.dtype == torch.bfloat16
    return args, constants


def decode_attention(q: torch.Tensor, kv: PagedKV, sm_scale: float, num_splits: int | None = None,
                     workspace: DecodeWorkspace | None = None, num_warps: int = 1, num_stages: int = 3,
                     maxnreg: int | None = None, kernel: str = DEFAULT_KERNEL) -> torch.Tensor:
    """Triton launch: q (B, HQ, D) -> (B, HQ, D), equal to decode_attention_ref within float tolerance.
    num_splits: programs sharing each (sequence, KV head)'s paged blocks (default: default_splits);
    num_warps / num_stages / maxnreg: warps per program, software-pipelining depth and register cap per thread
    (defaults tuned on the H200; maxnreg None: KERNEL_MAXNREG[kernel], 255 leaves it to the compiler); kernel: one
    of DECODE_KERNELS. With a workspace, its buffers are reused (see DecodeWorkspace); without, they are allocated
    per call."""
    bsz, hq, d = q.shape
    h = kv.k_fp.shape[1]
    launch = split_kernel(kernel)
    maxnreg = maxnreg or KERNEL_MAXNREG[kernel]
    if num_splits is None:
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = default_splits(bsz, h, max(1, kv.k_table.shape[1]), sm_count,
                                    resident_programs(maxnreg, num_warps))
    num_parts = num_splits + remaining_blocks(kv)
    q = q.contiguous()
    part_o, part_m, part_l, out = (workspace or DecodeWorkspace()).get(q, num_parts)
    args, constants = split_kernel_arguments(q, kv, sm_scale, (part_o, part_m, part_l), num_splits, kernel)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
    launch[(bsz, h, num_parts)](*args, **constants, **options)
    _merge_splits_kernel[(bsz * hq,)](part_o, part_m, part_l, out, num_parts, D=d,
                                      BLOCK_D=triton.next_power_of_2(d), BLOCK_S=16, num_warps=1)
    return out
