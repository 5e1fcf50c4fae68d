"""Decode attention of one new query per sequence over [sink | key/value pages | key Q-buffer | value tail].

Flash-decoding: each (sequence, KV head) gets NSPLIT programs that share its slots where both a key page and a
value page exist (a loop without branches, which Triton software-pipelines; or decode_gluon.py's kernel), and
decode_rest.py's programs take the other blocks (the sink, a key page whose values are still in the window, the
buffers), 32 tokens each. Each runs an online softmax for all query heads of the KV group and writes a partial
(max, sum, output); a small third kernel merges them with log-sum-exp weights. No score tensor and no
full-precision copy of the cache reach memory.

Dequantization is folded into the two products (exact algebra):
    q . k_t = sum_d (q_d * scale_d) * code_dt + sum_d q_d * zero_d           (keys: per-channel scale / zero)
    sum_t p_t v_t = sum_t (p_t * scale_t) * code_t + sum_t p_t * zero_t      (values: per-token scale / zero)
so the integer codes themselves are the matrix operands. The page layout (layout.py) keeps each product's
contracted dimension contiguous and puts a byte's four 2-bit fields in four quarters of the other dimension:
a 32-bit word of page data holds 4 contracted elements of each of 4 quarters, already in the order the matrix
units read them, and becomes 16 operand values with bit operations (`_quarters`): no shifting of tiles between
threads. Keys give scores by token quarter, values accumulate by channel quarter.

The products are written with the codes as the first operand, tokens (keys) or channels (values) on the rows of
the matrix instruction and the group's query heads on its columns:
    scores^T (tokens, heads)   = codes_k (tokens, channels) @ (q * scale)^T (channels, heads)
    out^T    (channels, heads) = codes_v (channels, tokens) @ (p * scale)^T (tokens, heads)
A tensor-core tile has 16 rows but only 8 columns, and a Qwen3-8B group has 4 query heads: with the heads on the
rows (the previous kernel) three quarters of every score and output tile were padding, which cost 4x the softmax
arithmetic and accumulator registers and held the kernel at 255 registers; on the columns half is padding, the
kernel runs at 128 registers with 16 programs per multiprocessor and is 1.3-1.6x faster (BENCHMARKS.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .decode_rest import (KEY_READS, launch_rest, rest_blocks_per_program, rest_maxnreg as default_rest_maxnreg,
                          rest_parts, rest_warps as default_rest_warps)
from .dequantize import dequantize_keys_ref, dequantize_values_ref
from .layout import PagedKV, key_tile_and_operand, value_tile_and_operand
from .unpack import MAGIC, field_weights, interpreted, unpack_asm, unpacking


# ---------------------------------------------------------------------------------------------- reference
def gather_kv(kv: PagedKV, b: int, dtype: torch.dtype, skip_pages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values in token order, (H, L, D) each, pages dequantized (the reference path).
    skip_pages: the first that many key and value pages left out (the tokens of i8_reference's paged slots)."""
    s, g = kv.sink, kv.page_size
    length, nkp, nvp = (int(x[b]) for x in (kv.seq_len, kv.n_kpages, kv.n_vpages))
    sink = min(length, s)
    kp, vp = kv.k_table[b, skip_pages:nkp].long(), kv.v_table[b, skip_pages:nvp].long()
    k_pages = dequantize_keys_ref(kv.k_low[kp], kv.k_high[kp], kv.k_ch[kp], kv.k_scale[kp], kv.k_zero[kp], dtype)
    v_pages = dequantize_values_ref(kv.v_low[vp], kv.v_high[vp], kv.v_scale[vp], kv.v_zero[vp], dtype)
    h, d = kv.k_fp.shape[1], kv.k_fp.shape[3]
    keys = torch.cat([kv.k_fp[b, :, :sink].to(dtype), k_pages.transpose(0, 1).reshape(h, -1, d),
                      kv.k_fp[b, :, s:s + length - sink - nkp * g].to(dtype)], dim=1)
    values = torch.cat([kv.v_fp[b, :, :sink].to(dtype), v_pages.transpose(0, 1).reshape(h, -1, d),
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
UNPACK_FP16 = tl.constexpr(unpack_asm(torch.float16))
UNPACK_BF16_OFFSET = tl.constexpr(unpack_asm(torch.bfloat16, offset=True))
# the bf16 operands of the offset unpacking: M + w_i * code (field_weights(torch.bfloat16) = 1, 4, 16, 1)
OFFSET_MAGIC = tl.constexpr(MAGIC[torch.bfloat16])
OFFSET_W1 = tl.constexpr(4.0)
OFFSET_W2 = tl.constexpr(16.0)


@triton.jit
def _quarters(x, DOT: tl.constexpr, ASM: tl.constexpr):
    """A uint8 tile -> its four 2-bit fields as DOT tiles, quarter i = bits 2i. ASM 2 (compiled, fp16 operands):
    the bit trick above, 4 bytes per 32-bit word; 0 (any dtype, the interpreter): shifts and conversions. (bf16
    operands take _quarters_offset.)"""
    if ASM == 2:
        return tl.inline_asm_elementwise(asm=UNPACK_FP16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                         pack=4)
    else:
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
    else:
        w = x.to(tl.int32)
        return ((w & 3).to(DOT) + OFFSET_MAGIC, ((w >> 2) & 3).to(DOT) * OFFSET_W1 + OFFSET_MAGIC,
                ((w >> 4) & 3).to(DOT) * OFFSET_W2 + OFFSET_MAGIC, ((w >> 6) & 3).to(DOT) + OFFSET_MAGIC)


@triton.jit
def _plane_products(tile, b, acc0, acc1, acc2, acc3, bsum, DOT: tl.constexpr, PREC: tl.constexpr,
                    ASM: tl.constexpr, OFFSET: tl.constexpr):
    """acc_i += (quarter i of the uint8 tile, the first operand) @ b. OFFSET: the quarters are M + w_i * code
    (_quarters_offset), and bsum gathers the column sums of b as the products see it (rounded to DOT), so that
    M * bsum can be taken out of acc_i afterwards."""
    if OFFSET:
        c0, c1, c2, c3 = _quarters_offset(tile, DOT, ASM)
        bsum += tl.sum(b.to(tl.float32), axis=0)
    else:
        c0, c1, c2, c3 = _quarters(tile, DOT, ASM)
    acc0 = tl.dot(c0, b, acc0, input_precision=PREC)
    acc1 = tl.dot(c1, b, acc1, input_precision=PREC)
    acc2 = tl.dot(c2, b, acc2, input_precision=PREC)
    acc3 = tl.dot(c3, b, acc3, input_precision=PREC)
    return acc0, acc1, acc2, acc3, bsum


KC = tl.constexpr(32)        # channels per key chunk: keeps one chunk's four unpacked quarters in registers


@triton.jit
def _program_slots(nkp_ptr, nvp_ptr, b, part, NSPLIT):
    """The paged slots [start, end) of sequence b that program `part` < NSPLIT reads: the slots with both a key page
    and a value page, shared evenly (decode_rest.py takes the other blocks)."""
    n_paged = tl.minimum(tl.load(nkp_ptr + b), tl.load(nvp_ptr + b))
    per_split = tl.cdiv(n_paged, NSPLIT)
    start = part * per_split
    return start, tl.minimum(start + per_split, n_paged)


@triton.jit
def _key_page_scores(q_cols, hmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, page,
                     D: tl.constexpr, G4: tl.constexpr, NB: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                     ASM: tl.constexpr, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G4: tl.constexpr,
                     BLOCK_NB: tl.constexpr):
    """Scores (log2 units) of the 4 token quarters of key page `page`, each (token, head). q_cols: (BLOCK_H,)
    pointers to the query rows, hmask: the real ones. OFFSET: the code operands are M + w_i * code
    (_quarters_offset); with bsum the column sums of the other operand, the products give M * bsum + w_i * scores,
    taken out exactly at the end."""
    j = tl.arange(0, BLOCK_G4)
    jmask = (j < G4)[:, None]
    s0 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s1 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s2 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s3 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    zq = tl.zeros((BLOCK_H,), tl.float32)
    bsum = tl.zeros((BLOCK_H,), tl.float32)
    for chunk in tl.static_range(0, D, KC):
        d = chunk + tl.arange(0, KC)
        dmask = d < D
        q = tl.load(q_cols[None, :] + d[:, None], mask=dmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        q = q * qk_scale                                                        # (channel, head)
        scale = tl.load(kscale_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)
        zero = tl.load(kzero_ptr + page * D + d, mask=dmask, other=0.0).to(tl.float32)
        zq += tl.sum(q * zero[:, None], axis=0)
        b = (q * scale[:, None]).to(DOT)
        tile, b = key_tile_and_operand(klow_ptr + page * (G4 * D), j, d, jmask & dmask[None, :], b, G4,
                                       D)                                       # (token-in-quarter, channel)
        s0, s1, s2, s3, bsum = _plane_products(tile, b, s0, s1, s2, s3, bsum, DOT, PREC, ASM, OFFSET)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        r = tl.arange(0, BLOCK_NB)
        nbmask = r < NB
        ch = tl.load(kch_ptr + page * NB + r, mask=nbmask, other=0).to(tl.int32)
        ch_scale = tl.load(kscale_ptr + page * D + ch, mask=nbmask, other=0.0).to(tl.float32)
        q_ch = tl.load(q_cols[None, :] + ch[:, None], mask=nbmask[:, None] & hmask[None, :], other=0.0)
        b = (q_ch.to(tl.float32) * qk_scale * (4.0 * ch_scale)[:, None]).to(DOT)
        tile, b = key_tile_and_operand(khigh_ptr + page * (G4 * NB), j, r, jmask & nbmask[None, :], b, G4, NB)
        s0, s1, s2, s3, bsum = _plane_products(tile, b, s0, s1, s2, s3, bsum, DOT, PREC, ASM, OFFSET)
    if OFFSET:                                          # s_i = M * bsum + w_i * scores_i
        offset = OFFSET_MAGIC * bsum
        return (s0 + (zq - offset)[None, :], s1 * (1.0 / OFFSET_W1) + (zq - offset / OFFSET_W1)[None, :],
                s2 * (1.0 / OFFSET_W2) + (zq - offset / OFFSET_W2)[None, :], s3 + (zq - offset)[None, :])
    else:
        zq = zq[None, :]
        return s0 + zq, s1 + zq, s2 + zq, s3 + zq


@triton.jit
def _online_softmax(s0, s1, s2, s3, m_i, l_i, G4: tl.constexpr, BLOCK_G4: tl.constexpr):
    """The 4 quarters' scores of a full page ((token, head) tiles in log2 units, rows past G4 padding, masked out)
    update the running max and sum per head. Returns the probabilities, the factor the running output must be
    multiplied by, the new max / sum."""
    if BLOCK_G4 != G4:
        j = tl.arange(0, BLOCK_G4)
        jmask = (j < G4)[:, None]
        s0 = tl.where(jmask, s0, float("-inf"))
        s1 = tl.where(jmask, s1, float("-inf"))
        s2 = tl.where(jmask, s2, float("-inf"))
        s3 = tl.where(jmask, s3, float("-inf"))
    # one reduction across the tile's rows (threads) for the 4 quarters, after an elementwise max / sum in registers
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), axis=0))
    alpha = tl.math.exp2(m_i - m_new)
    p0 = tl.math.exp2(s0 - m_new[None, :])
    p1 = tl.math.exp2(s1 - m_new[None, :])
    p2 = tl.math.exp2(s2 - m_new[None, :])
    p3 = tl.math.exp2(s3 - m_new[None, :])
    l_i = l_i * alpha + tl.sum((p0 + p1) + (p2 + p3), axis=0)
    return p0, p1, p2, p3, alpha, m_new, l_i


@triton.jit
def _value_quarter(p, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, page,
                   quarter: tl.constexpr, G: tl.constexpr, D4: tl.constexpr, V_BITS: tl.constexpr,
                   DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr,
                   BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr):
    """Accumulate token quarter `quarter` of value page `page` (p: (token, head)): the 4 channel quarters into
    acc0..acc3 ((channel, head) each) and the zero-point term sum_t p_t * zero_t into zacc. OFFSET: the code
    operands are M + w_i * code, so acc_i also gathers M * pacc (pacc: the column sums of the other operand)."""
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    c = tl.arange(0, BLOCK_D4)
    tok = quarter * G4 + j
    jmask = j < G4
    vscale = tl.load(vscale_ptr + page * G + tok, mask=jmask, other=0.0).to(tl.float32)
    vzero = tl.load(vzero_ptr + page * G + tok, mask=jmask, other=0.0).to(tl.float32)
    zacc += tl.sum(p * vzero[:, None], axis=0)
    b = (p * vscale[:, None]).to(DOT)
    mask = (c < D4)[:, None] & jmask[None, :]                                # (channel byte, token), layout.py
    tile, bt = value_tile_and_operand(vlow_ptr + page * (D4 * G), c[:, None], tok[None, :], mask, b, G, D4)
    acc0, acc1, acc2, acc3, pacc = _plane_products(tile, bt, acc0, acc1, acc2, acc3, pacc, DOT, PREC, ASM, OFFSET)
    if V_BITS == 4:
        b = (b.to(tl.float32) * 4.0).to(DOT)                                   # exact: the high bits weigh 4
        tile, bt = value_tile_and_operand(vhigh_ptr + page * (D4 * G), c[:, None], tok[None, :], mask, b, G, D4)
        acc0, acc1, acc2, acc3, pacc = _plane_products(tile, bt, acc0, acc1, acc2, acc3, pacc, DOT, PREC, ASM,
                                                       OFFSET)
    return acc0, acc1, acc2, acc3, zacc, pacc


@triton.jit
def _pick(x0, x1, x2, x3, i: tl.constexpr):
    """x_i, chosen at compile time (i: a static_range index): Triton cannot index a tuple of tensors by a loop
    variable."""
    x = x0
    if i == 1:
        x = x1
    if i == 2:
        x = x2
    if i == 3:
        x = x3
    return x


@triton.jit
def _value_page(p0, p1, p2, p3, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
                vpage, G: tl.constexpr, D4: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr,
                PREC: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr, BLOCK_G4: tl.constexpr,
                BLOCK_D4: tl.constexpr):
    """All 4 token quarters of value page `vpage`."""
    for quarter in tl.static_range(4):
        acc0, acc1, acc2, acc3, zacc, pacc = _value_quarter(
            _pick(p0, p1, p2, p3, quarter), acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr, vscale_ptr,
            vzero_ptr, vpage, quarter, G, D4, V_BITS, DOT, PREC, ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    return acc0, acc1, acc2, acc3, zacc, pacc


@triton.jit
def _paged_values(s0, s1, s2, s3, m_i, l_i, acc0, acc1, acc2, acc3, zacc, pacc, vpage, vlow_ptr, vhigh_ptr,
                  vscale_ptr, vzero_ptr, G: tl.constexpr,
                  D4: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
                  OFFSET: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr):
    """The rest of a paged slot once its key page's scores are known: the online softmax, the running output
    rescaled, and the slot's value page `vpage` accumulated. Returns the new max, sum and accumulators."""
    G4: tl.constexpr = G // 4
    p0, p1, p2, p3, alpha, m_i, l_i = _online_softmax(s0, s1, s2, s3, m_i, l_i, G4, BLOCK_G4)
    alpha_row = alpha[None, :]
    acc0, acc1, acc2, acc3 = acc0 * alpha_row, acc1 * alpha_row, acc2 * alpha_row, acc3 * alpha_row
    zacc, pacc = zacc * alpha, pacc * alpha
    acc0, acc1, acc2, acc3, zacc, pacc = _value_page(p0, p1, p2, p3, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr,
                                                     vhigh_ptr, vscale_ptr, vzero_ptr, vpage, G, D4, V_BITS, DOT,
                                                     PREC, ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    return m_i, l_i, acc0, acc1, acc2, acc3, zacc, pacc


# Sizes that grow during generation are not specialized on (Triton would compile a new variant whenever one
# becomes a multiple of 16, stalling a decode step for a second or more).
@triton.jit(do_not_specialize=["KMP", "VMP", "NSPLIT", "NPART"])
def _decode_split_kernel(
        q_ptr, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, KMP, VMP, NSPLIT, NPART,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
        NB: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
        OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr,
        BLOCK_NB: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, h, part < NSPLIT): the paged slots of sequence b, KV head h that _program_slots gives it, written
    as partial (output, max, sum) number `part`. PDL: the remaining blocks' kernel after it may start at once
    (decode_launches' pdl)."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    start, end = _program_slots(nkp_ptr, nvp_ptr, b, part, NSPLIT)

    heads = tl.arange(0, BLOCK_M)                        # BLOCK_M: the query heads of the group, padded
    hmask = heads < GROUP
    q_cols = q_ptr + (b * H * GROUP + h * GROUP + heads).to(tl.int64) * D

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    zacc = tl.zeros((BLOCK_M,), tl.float32)
    pacc = tl.zeros((BLOCK_M,), tl.float32)         # OFFSET: the sum the value accumulators hold M times
    acc0 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc1 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc2 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc3 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)

    # both pages of a paged slot are quantized: no branch in the loop bodies
    for slot in range(start, end):
        kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
        vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
        s0, s1, s2, s3 = _key_page_scores(q_cols, hmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                          kzero_ptr, kpage, D, G4, NB, DOT, PREC, ASM, OFFSET, BLOCK_M, BLOCK_G4,
                                          BLOCK_NB)
        m_i, l_i, acc0, acc1, acc2, acc3, zacc, pacc = _paged_values(
            s0, s1, s2, s3, m_i, l_i, acc0, acc1, acc2, acc3, zacc, pacc, vpage, vlow_ptr, vhigh_ptr, vscale_ptr,
            vzero_ptr, G, D4, V_BITS, DOT, PREC, ASM, OFFSET, BLOCK_G4, BLOCK_D4)

    idx = (b * H * GROUP + h * GROUP + heads).to(tl.int64) * NPART + part
    tl.store(pm_ptr + idx, m_i, mask=hmask)
    tl.store(pl_ptr + idx, l_i, mask=hmask)
    c = tl.arange(0, BLOCK_D4)
    out = po_ptr + idx[None, :] * D + c[:, None]
    omask = (c < D4)[:, None] & hmask[None, :]
    if OFFSET:                                          # acc_i = M * pacc + w_i * output: take M and w_i out
        offset = OFFSET_MAGIC * pacc
        tl.store(out, acc0 + (zacc - offset)[None, :], mask=omask)
        tl.store(out + D4, acc1 * (1.0 / OFFSET_W1) + (zacc - offset / OFFSET_W1)[None, :], mask=omask)
        tl.store(out + 2 * D4, acc2 * (1.0 / OFFSET_W2) + (zacc - offset / OFFSET_W2)[None, :], mask=omask)
        tl.store(out + 3 * D4, acc3 + (zacc - offset)[None, :], mask=omask)
    else:
        zrow = zacc[None, :]
        tl.store(out, acc0 + zrow, mask=omask)
        tl.store(out + D4, acc1 + zrow, mask=omask)
        tl.store(out + 2 * D4, acc2 + zrow, mask=omask)
        tl.store(out + 3 * D4, acc3 + zrow, mask=omask)


@triton.jit(do_not_specialize=["NPART"])
def _merge_splits_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, NPART, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_DC: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, query head) row and BLOCK_DC of its channels: the partials of all NPART parts merged with
    log-sum-exp weights in one pass (a running maximum rescales what is summed so far), BLOCK_S parts per step.
    PDL: launched while the kernels that write the partials still run (decode_launches' pdl): it waits for them
    first."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    dmask = d < D
    m_run = float("-inf")
    den = 0.0
    num = tl.zeros((BLOCK_DC,), tl.float32)
    for first in range(0, NPART, BLOCK_S):
        sp = first + tl.arange(0, BLOCK_S)
        smask = sp < NPART
        m = tl.load(pm_ptr + row * NPART + sp, mask=smask, other=float("-inf"))
        lsum = tl.load(pl_ptr + row * NPART + sp, mask=smask, other=0.0)
        o = tl.load(po_ptr + (row * NPART + sp[:, None]) * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                    other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.where(m_run > float("-inf"), tl.math.exp2(m_run - m_new), 0.0)
        w = tl.where(m > float("-inf"), tl.math.exp2(m - m_new), 0.0)      # empty parts (m = -inf) weigh 0
        den = den * alpha + tl.sum(lsum * w, 0)
        num = num * alpha + tl.sum(o * w[:, None], 0)
        m_run = m_new
    tl.store(out_ptr + row * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=dmask)


# The merge reads every part of every row once, MERGE_TILE floats (BLOCK_S parts x BLOCK_DC channels) per step. A
# row's channels are split over programs while there are too few rows to fill the GPU: a batch of one (32 rows for
# Qwen3-8B) takes 4 programs of 64 parts x 32 channels per row (21.6 instead of 28.0 us at batch 1 / 32K, where one
# one-warp program per row looped 16 parts at a time; BENCHMARKS.md section 1); from 4 rows per multiprocessor on
# (Qwen3-8B: batch 17 and up) each row is one program reading 16 parts x 128 channels a step, the earlier merge's
# tile. Measured and not kept: the merge without a launch, by the last remaining program of each (sequence, KV head),
# which waited for its paged programs' counts (release adds, an acquire wait): on an H100 beside the paged kernel by
# PDL, equal at batch 64 / 32K (kitty-pro 481.5 and 484.4 against 480.4 and 485.5 us; kivi-k2v2 1.4-2.0 faster),
# 5 us slower at 64 / 4K and 2-3.5x slower at batch 1, where one program merged a row's 136 parts (BENCHMARKS.md
# section 1, session 38; commit bd2acc7). Nor, with no wait, by whichever program of the pair (paged, in Gluon, or
# remaining) stored its partial last (an acquire-release add a program): on an H100 0.2-0.9 us faster at 64 / 32K
# in 4 of 4 pairs (467.5-468.3 against 468.0-468.6), slower at every other shape measured (32 / 32K by 2.2, 8 / 32K
# by 18, 32 / 4K by 13.5, 8 / 4K by 18, 1 / 32K by 91: one program's serial merge is the call's end); not measured
# on an H200 (BENCHMARKS.md section 1, session 43; commit 0307825).
MERGE_TILE = 2048
MERGE_WARPS = 2


def merge_blocks(rows: int, d: int, sm_count: int, num_parts: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_DC) of the merge for `rows` (sequence, query head) rows of d channels and num_parts parts.
    Channel blocks shrink down to 8 until one step reads all parts (up to 256): batch 1 / 32K of Qwen3-8B has 136
    parts, read as 256 x 8 tiles by 16 programs a row instead of three dependent steps of 64 x 32 (merge 2.3
    against 3.1 us, no change at the other five shapes; BENCHMARKS.md section 1, session 13)."""
    block_dc = triton.next_power_of_2(d)
    while block_dc > 32 and rows * triton.cdiv(d, block_dc) < 4 * sm_count:
        block_dc //= 2
    while block_dc > 8 and MERGE_TILE // block_dc < num_parts:
        block_dc //= 2
    return MERGE_TILE // block_dc, block_dc


def dot_dtype(dtype: torch.dtype):
    """Operand type of the matrix products: the model's half type on a GPU. Triton's CPU interpreter computes
    bfloat16 arithmetic wrongly (numpy has no bfloat16), so interpreted bfloat16 runs use float32 operands."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreted():
        return tl.bfloat16
    return tl.float32


def precision(dot) -> str:
    """tl.dot's input precision for operands of type `dot` (float32 ones only on the interpreter: exact there)."""
    return "ieee" if dot == tl.float32 else "tf32"


REGISTERS_PER_SM = 65536      # 32-bit registers of an H100 / H200 multiprocessor (what bounds resident programs here)
# Register cap per thread of the decode kernel. The compiler takes 255 (8 resident one-warp programs per
# multiprocessor); at 128 the main loop spills about 50 of its ~2,500 instructions per page to L1, and the 16
# resident programs more than pay for that: 801 against 1,108 us at batch 64 / 32K (BENCHMARKS.md section 1).
MAXNREG = 128
MIN_PAGES_PER_SPLIT = 2       # a program's set-up and first page's latency outweigh a single page of work


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stand in for a CPU (the interpreter), where the launch shapes
    only have to be valid."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def resident_programs(maxnreg: int, num_warps: int = 1) -> int:
    """Programs of the decode kernel resident on one multiprocessor at `maxnreg` registers per thread: 8 one-warp
    programs at the compiler's 255, 16 at a cap of 128."""
    return REGISTERS_PER_SM // (32 * num_warps * maxnreg)


def default_splits(batch: int, kv_heads: int, max_pages: int, sm_count: int = 132,
                   resident: int = resident_programs(MAXNREG)) -> int:
    """Programs over the paged blocks per (sequence, KV head): one wave of `resident` programs per multiprocessor
    (a wave that is a few programs over costs a whole second wave), with at least MIN_PAGES_PER_SPLIT pages each;
    one page each where that grid fills at most a quarter of a wave (the GPU is mostly idle and each program's
    latency is the time: batch 1 / 4K, 13.0 against 14.2 us; at 2,048 such programs, batch 8 / 4K and batch 1 /
    32K, two pages each win). Fitted to the H200 sweeps in BENCHMARKS.md (`python -m backend.bench tune`)."""
    wave = resident * sm_count
    if 4 * batch * kv_heads * max_pages <= wave:
        return max(1, min(max_pages, 256))
    return max(1, min(wave // (batch * kv_heads), triton.cdiv(max_pages, MIN_PAGES_PER_SPLIT), 256))


# The Gluon kernel's split (balanced_splits): fewer programs than a full wave where that evens out the pages of the
# busiest scheduler, down to this many programs a multiprocessor (2 warps a scheduler; at 6 the kernel ran 17 %
# slower at batch 8 / 32K), if it takes at least BALANCE_GAIN off that load
MIN_BALANCED_PROGRAMS = 8
BALANCE_GAIN = 0.03
SCHEDULERS_PER_SM = 4


def balanced_splits(batch: int, kv_heads: int, max_pages: int, sm_count: int, resident: int) -> int:
    """Programs over the paged blocks per (sequence, KV head) for the Gluon kernel: one page each where all of them
    fit one wave (batch 2 / 4K: 12.9 against 14.1 us at two pages each); else the split whose busiest warp scheduler
    has the fewest pages to do, ceil(programs a multiprocessor / 4) x ceil(pages / split), among the waves of
    MIN_BALANCED_PROGRAMS to `resident` programs a multiprocessor, unless it is within BALANCE_GAIN of the full
    wave's. Why: the one-warp programs of a multiprocessor share its 4 schedulers, and the one with the most warps
    sets the time (batch 8 / 32K: 16 splits, 8 programs a multiprocessor, 2 a scheduler with 16 pages each, 74.0-74.6
    us; the full wave's 24 splits, 3 a scheduler with 11 pages, 77.6-77.8 us; batch 4 / 32K: 37 splits, 9 programs,
    so 3 on one scheduler with 7 pages, 49.2 us, where 33 splits took 45.8; BENCHMARKS.md section 1, session 16)."""
    pairs = batch * kv_heads
    if pairs * max_pages <= resident * sm_count:
        return max(1, min(max_pages, 256))

    def split(programs_per_sm):
        return max(1, min(programs_per_sm * sm_count // pairs, max_pages, 256))

    def busiest(n):
        per_sm = -(-pairs * n // sm_count)
        return -(-per_sm // SCHEDULERS_PER_SM) * -(-max_pages // n)

    full = split(resident)
    best = min((split(r) for r in range(min(MIN_BALANCED_PROGRAMS, resident), resident + 1)), key=busiest)
    return best if busiest(best) <= (1 - BALANCE_GAIN) * busiest(full) else full


class DecodeWorkspace:
    """decode_attention's partial results and output, kept between calls of one layer so that a decode step
    allocates nothing (and a captured CUDA graph keeps its addresses), and the TMA descriptors of the layer's
    pages. The output returned by a call is overwritten by the next call with the same workspace."""

    def __init__(self):
        self.buffers: tuple[torch.Tensor, ...] = ()
        self.rows: torch.Tensor | None = None
        self.descriptor_key: tuple | None = None
        self.descriptors: tuple = ()

    def get(self, q: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, ...]:
        bsz, hq, d = q.shape
        out = self.buffers[3] if self.buffers else None
        if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
                or self.buffers[1].shape[2] != num_parts:
            part_o = torch.empty((bsz, hq, num_parts, d), dtype=torch.float32, device=q.device)
            part_m = torch.empty((bsz, hq, num_parts), dtype=torch.float32, device=q.device)
            self.buffers = (part_o, part_m, torch.empty_like(part_m), torch.empty_like(q))
        return self.buffers

    def query_rows(self, q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
        """The Gluon kernel's transposed queries (its "q-rows" experiment: decode_gluon.query_rows_shape, fp16),
        kept like the partials."""
        from . import decode_gluon
        shape = decode_gluon.query_rows_shape(q, kv)
        if self.rows is None or self.rows.shape != shape or self.rows.device != q.device:
            self.rows = torch.empty(shape, dtype=torch.float16, device=q.device)
        return self.rows

    def tma_descriptors(self, kv: PagedKV, head_dim: int) -> tuple:
        """decode_gluon.tma_descriptors(kv, head_dim), made again only when a page tensor has moved or changed
        shape (a cache's pools grow by reallocation): making them takes about 170 us on CI's CPU, in every layer's
        every decode step that no CUDA graph replays; this check takes 6."""
        from . import decode_gluon
        key = (head_dim, *((t.data_ptr(), t.shape, t.stride()) for t in decode_gluon.page_tensors(kv)))
        if key != self.descriptor_key:
            self.descriptors, self.descriptor_key = decode_gluon.tma_descriptors(kv, head_dim), key
        return self.descriptors


def split_kernel_arguments(q, kv: PagedKV, sm_scale: float, parts, num_splits: int) -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _decode_split_kernel for one launch of num_splits programs
    per (sequence, KV head) over the paged slots; parts are the (output, max, sum) partials. Also used to compile
    the kernel for a profile. BLOCK_M: the group's query heads padded to the matrix instruction's 8 columns.
    BLOCK_NB: the boosted channels padded to at least 32, so that kitty's 16 take kitty-pro's layouts (with 16
    columns its high-bits tile needed other layouts and shared-memory moves: 2,640 instructions per page and 12.5 KB
    of shared memory against 2,396 and 9.7 KB; BENCHMARKS.md section 1). OFFSET: bf16 code operands stay M + w *
    code (_quarters_offset); fp16 ones are exact codes, because fp16's M = 1024 would leave too few bits after the
    offset is taken out."""
    part_o, part_m, part_l = parts
    bsz, hq, d = q.shape
    h, g = kv.k_fp.shape[1], kv.page_size
    args = (q, kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero, kv.v_low, kv.v_high, kv.v_scale, kv.v_zero,
            kv.k_table, kv.v_table, kv.n_kpages, kv.n_vpages, part_o, part_m, part_l, sm_scale * math.log2(math.e),
            kv.k_table.shape[1], kv.v_table.shape[1], num_splits, part_m.shape[2])
    dot = dot_dtype(q.dtype)
    constants = dict(H=h, GROUP=hq // h, D=d, G=g, NB=kv.n_boost, V_BITS=kv.v_bits, DOT=dot, PREC=precision(dot),
                     ASM=unpacking(dot),
                     OFFSET=q.dtype == torch.bfloat16, BLOCK_M=max(8, triton.next_power_of_2(hq // h)),
                     BLOCK_G4=max(16, triton.next_power_of_2(g // 4)), BLOCK_D4=max(16, triton.next_power_of_2(d // 4)),
                     BLOCK_NB=max(32, triton.next_power_of_2(kv.n_boost)))
    return args, constants


KERNELS = ("auto", "triton", "gluon", "gluon-tma", "gluon-tma-i8k", "gluon-tma-i8")
# The Gluon kernel (decode_gluon.py) spends about 1,380 instructions per page against Triton's 2,420
# (`python -m kernels.sass_profile --kernel gluon`). Until session 12 it lost where programs take one or two pages
# (batch 1, batch 8 at 4K): there the Triton kernel ran the remaining blocks in the same launch, and the Gluon kernel
# needed a second, slow one. With the remaining blocks in decode_rest.py for both, the Gluon kernel is 1.2-1.6x faster
# than the Triton one at every shape measured (BENCHMARKS.md section 1, session 12): "auto" takes it wherever it
# applies.
GLUON_MAXNREG = 168           # 12 resident programs per multiprocessor, as at 129-167 (decode_gluon.resident_programs);
                              # 128 gives 16, with spills (measured slower), 176-255 fewer
# ... and where the split leaves at most 8 programs a multiprocessor (balanced_splits), which 192 registers still
# hold, 192: the compiler's own 176 then schedule the page loop better, 1-4 % faster at 11 of the 12 Qwen3-8B shapes
# that take it (batches 1-16 / 32K, 1-64 / 4K; BENCHMARKS.md section 1, session 16, call 4)
GLUON_MAXNREG_FEW = 192
# "gluon-tma": the Gluon kernel with its pages copied by TMA instead of cp.async (decode_gluon's _tma_keys: why,
# there), on Hopper. Measured on the H200 in one run against cp.async (BENCHMARKS.md section 1, session 16, call 5):
# 446.2 against 482.6 us at batch 64 / 32K, 66.4 against 74.8 at 8 / 32K, 87.9 against 96.1 at 64 / 4K, 18.7
# against 19.2 at 1 / 32K, equal at 1 / 4K: "auto" takes it wherever it applies, and "gluon" (cp.async) elsewhere
# (GPUs before Hopper)
# "gluon-tma-i8k": the same with the key products on the integer matrix unit (decode_gluon's I8_QUARTER_ASM: the
# queries times scales rounded to 8 bits a page); "gluon-tma-i8": the value products too (p times scales rounded to
# 8 bits a page). Experiments: they change the numbers (see BENCHMARKS.md section 1, session 20; on the default model
# kitty-pro's KL from full precision 0.0302 exact, 0.0301 / 0.0305 with them, kivi-k2v2's 0.4023, 0.4163 / 0.4423:
# section 3, `python -m backend.bench quality`)
# Experiments: a Gluon kernel's name may add any of GLUON_EXPERIMENTS, "+name" each ("gluon-tma+zq-ahead+fold-max"),
# so that one run can time them alone and together (decode_gluon.kernel_options turns them into the kernel's flags):
# - "zq-ahead": the keys' zero term sum_d q_d * zero_d of 16 pages a product, ZQ_SLOTS slots ahead, with the pages'
#   zeros as the first operand's rows, instead of 8 products with ones a page (decode_gluon's ZQ_AHEAD);
# - "fold-max": the scores' quarter weights and zero term applied in the exponent's multiply-add, after the page's
#   maximum is taken from the unweighted sums (decode_gluon's FOLD_MAX: 32 fewer FADD a page, fp16 key products);
# - "q-rows": the boosted channels' queries read from a transposed copy that each program writes first, a channel's
#   8 heads in one 16-byte load (decode_gluon's Q_ROWS, fp16 key products; DecodeWorkspace.query_rows).
# Measured on an H100 (BENCHMARKS.md section 1, session 35): no faster at batch 64 (kitty-pro 483.7 and 483.4 against
# 483.8 us a call at 64 / 32K, the arithmetic alone 323.6 and 321.7 against 319.4), 0.3-0.7 us slower at batches 1
# and 8. On the H200, whose power cap is what they were written for (session 38, one run): both together 391.5
# against 397.9 us for kitty-pro at 64 / 32K (4.84x SDPA against 4.76x) and 330.9 against 338.4 for kivi-k2v2; at
# 1 / 32K equal for kitty-pro (13.0) and 0.5 us slower for kivi-k2v2 (11.9 against 11.4); zq-ahead alone 1.0 slower
# for kitty-pro at 64 / 32K. So "auto" takes both where a program walks many pages (folds_max). q-rows with both, on
# the H200 (session 39): kitty-pro at 64 / 32K 372.0, 373.9 and 372.8 against 375.6 and 375.0 us (two runs; 4.98x
# SDPA at best), equal at 32 / 32K (191.9 against 191.1), slower at 1 / 32K (14.3 against 12.9) and for kitty, whose
# 16 boosted channels leave half the lanes idle (356.4 against 351.2 at 64 / 32K, 183.3 against 180.8 at 32 / 32K):
# "auto" adds it where a program walks ROWS_PAGES pages and the keys have ROWS_BOOSTED boosted channels (reads_rows),
# on a device whose memory reads at least ROWS_MIN_GBS: on an H100 SXM (3,352 GB/s) q-rows was slower, kitty-pro at
# 64 / 32K 466.4-467.6 us a call with it against 458.2-459.3 without (FOLDED_KERNEL and the plain kernel, two runs;
# BENCHMARKS.md section 1, session 45), where the launch waits on its copies (428 of its 456 us) more than on power.
# Deleted after measuring (BENCHMARKS.md section 1, sessions 44 and 45):
# - "lazy-rescale" (session 45; commit 920898c holds it), the running sums rescaled only on pages that raise some
#   head's maximum (1,147 instructions a kitty-pro page on the pages that skip it against 1,176): on an H100 its
#   arithmetic alone took 306.4 against 314.6 us at 64 / 32K, but at 539 against 529 W, the same energy (127.8
#   against 128.0 mJ a call), and its power-capped paged launch and call were no faster (478.7 and 489.0 against
#   477.2 and 488.6 us);
# - "two-rows" (session 44; commit 3b1405b holds it), the sums of p and of p * zero from a first operand with the
#   zeros in row 0 and ones in row 8 and zeros elsewhere instead of 8 copies of each, for the matrix unit's power: on
#   the H200 equal (388.3 and 389.4 against 388.0, 388.6 and 391.6 us a call at 64 / 32K) and its arithmetic alone
#   drew 378 W against 380, within the readings' spread;
# - "pairs" (session 44; commit 97aa8f3), two token quarters a score tile, the second's scores shuffled into the
#   first's padding heads' columns (8 fewer instructions and 4 fewer products a kitty-pro page, sm_90): on an H100
#   the call was 7.6 us slower at 64 / 32K and its arithmetic alone took longer (315.8 against 314.0 us) at more
#   power (449 against 429 W): the shuffles and the shared-memory round trip lengthen each warp's page, and 3 warps a
#   scheduler do not hide that.
GLUON_KERNELS = ("gluon", "gluon-tma", "gluon-tma-i8k", "gluon-tma-i8")
GLUON_EXPERIMENTS = ("zq-ahead", "fold-max", "q-rows")
FOLDED_KERNEL = "gluon-tma+zq-ahead+fold-max"
ROWS_KERNEL = FOLDED_KERNEL + "+q-rows"
ROWS_PAGES = 64                    # measured faster at 85 pages a program, equal at 43
ROWS_BOOSTED = 32                  # kitty-pro's at head_dim 128; kitty's 16 measured slower, other counts not measured
# measured faster on the H200 (4.8 TB/s by its specification), slower on the H100 SXM (3,352 GB/s by its properties);
# none between the two was measured. The line is drawn 10 % above the H100's, so that an H200 keeps it even where its
# driver reports a bus or clock off its specification (a B200's driver once reported 8,192 bits for its 7,680)
ROWS_MIN_GBS = 3700
# Pages a program from which "auto" takes FOLDED_KERNEL: on the H200 faster for kitty-pro, kitty and kivi-k2v2 at 86,
# 43 and 32 (Qwen3-8B's batch 64 / 32K; 32 / 32K and 64 / 16K; 32 / 16K: by 7.5-6.9, 4.5-1.7, 3.5-1.0 and 1.0-0.7 us
# a call, one run, BENCHMARKS.md section 1, session 39), not at 2 (1 / 32K, session 38); a program's zero terms come
# ZQ_SLOTS (16) pages a window, so a few pages pay the window for little. The launches of 16 pages a program (8 /
# 32K, 64 / 4K) are not measured with it and keep the plain kernel.
FOLD_PAGES = 32


def kernel_parts(kernel: str) -> tuple[str, tuple[str, ...]]:
    """decode_attention's `kernel` -> (its base, the experiments its name adds): ("gluon-tma", ("zq-ahead",)) for
    "gluon-tma+zq-ahead". ValueError for a name decode_attention does not take: a base outside KERNELS,
    experiments on a kernel that is not a Gluon kernel, an unknown or repeated experiment, "fold-max" without
    "zq-ahead" or on the 8-bit key products (it folds the fp16 key products' weights and zq-ahead's terms), or
    "q-rows" on the 8-bit key products."""
    base, *extras = kernel.split("+")
    if base not in KERNELS or (extras and base not in GLUON_KERNELS):
        raise ValueError(f"unknown decode kernel {kernel!r}: choose one of {', '.join(KERNELS)}, a Gluon kernel "
                         f"({', '.join(GLUON_KERNELS)}) with experiments +{', +'.join(GLUON_EXPERIMENTS)}")
    unknown = [e for e in extras if e not in GLUON_EXPERIMENTS or extras.count(e) > 1]
    if unknown:
        raise ValueError(f"decode kernel {kernel!r}: unknown or repeated experiments {unknown}; a Gluon kernel takes "
                         f"each of +{', +'.join(GLUON_EXPERIMENTS)} once")
    if "fold-max" in extras and (base.endswith(("i8k", "i8")) or "zq-ahead" not in extras):
        raise ValueError(f"decode kernel {kernel!r}: fold-max folds the fp16 key products' weights and the zero "
                         "terms of zq-ahead into the exponent: it takes a kernel with both")
    if "q-rows" in extras and base.endswith(("i8k", "i8")):
        raise ValueError(f"decode kernel {kernel!r}: q-rows builds the fp16 key products' boosted operand")
    return base, tuple(extras)


def check_kernel(kernel) -> str:
    """`kernel` if decode_attention takes it (kernel_parts), else ValueError naming the choices: the check of
    make_cache's decode_kernel and the bench's --kernels."""
    if not isinstance(kernel, str):
        raise ValueError(f"decode kernel {kernel!r} is not a name: choose one of {', '.join(KERNELS)}")
    kernel_parts(kernel)
    return kernel


def is_gluon(kernel: str) -> bool:
    """Whether decode_attention's `kernel` (a name kernel_parts takes) is a Gluon kernel."""
    return kernel_parts(kernel)[0] in GLUON_KERNELS


# decode_launches' pdl by default: the paged kernel first and the other two launched beside it. Measured on the H200
# against the three launches in a row: faster at 27 of 28 tune pairs (14 shapes, two copy paths), 11.4 -> 7.9 us at
# batch 1 / 4K, 17.4 -> 14.7 at 1 / 32K, equal at 64 / 32K (BENCHMARKS.md section 1, session 18, call 3)
PDL = True

# decode_launches' rest_keys by default: how the remaining blocks of a key page read its codes, one of
# decode_rest.KEY_READS or "auto" (choose_rest_keys): "codes" (each byte's one 2-bit field by inline PTX as the
# product's operand, the page's scales on the queries) where their programs take CODES_BLOCKS blocks or more, beside
# long paged launches, or have a multiprocessor each (batch 1), else "elements" (the keys dequantized to float32 one
# element at a time). Compiled for sm_90 with triton 3.6, a kitty-pro key page's block takes 851 instructions a warp
# with "codes" against 1,075 (kernels.sass_profile --kernel rest --rest-keys codes --blocks). Measured on H100s
# (bench tune --vary rest-keys; BENCHMARKS.md section 1, session 40): at batch 64 / 32K (5 blocks a program) "codes"
# was faster for kitty-pro in all 5 comparisons of 3 runs (by 0.6-1.5 us a call) and for kitty in both (0.9,
# 1.4), equal for kivi-k2v2 (within 0.2); at batch 1 faster at all 6 shapes (0.1-0.9 us); at batch 8 slower in
# all 14 comparisons (3.2-7.3 us: a program of its 16 KB of shared memory, against 12 KB, seems not to fit beside
# the paged ones) and at 64 / 4K in all 7 (1.0-4.2), one block a program there too. A third way, the fields
# dequantized in float32 as before (981 instructions), was within 0.6 us of "elements" in 15 of 16 comparisons and
# 1.2 faster for kitty at 64 / 32K, where "codes" was 1.4 faster: deleted.
REST_KEYS = "auto"
CODES_BLOCKS = 5


def split_count(q: torch.Tensor, kv: PagedKV, kernel: str, maxnreg: int, num_warps: int = 1,
                sm_count: int | None = None) -> int:
    """The split of a launch of `kernel` ("triton" or a Gluon kernel) at its register cap: default_splits of the
    programs a multiprocessor holds for the Triton kernel, balanced_splits of those (by registers and shared memory)
    for the Gluon kernel; on sm_count multiprocessors (default: q's device's)."""
    shape = (q.shape[0], kv.k_fp.shape[1], max(1, kv.k_table.shape[1]), sm_count or multiprocessors(q.device))
    if is_gluon(kernel):
        from . import decode_gluon
        zq_ahead = decode_gluon.kernel_options(kernel)["zq_ahead"]
        return balanced_splits(*shape, decode_gluon.resident_programs(kv, q.shape[-1], maxnreg, zq_ahead))
    return default_splits(*shape, resident_programs(maxnreg, num_warps))


def gluon_maxnreg(q: torch.Tensor, kv: PagedKV, num_splits: int, kernel: str = "gluon-tma") -> int:
    """The Gluon kernel's (`kernel`'s) default register cap for a launch of num_splits programs per (sequence, KV
    head): GLUON_MAXNREG_FEW where they are at most as many a multiprocessor as that cap leaves resident, else
    GLUON_MAXNREG."""
    from . import decode_gluon
    per_sm = -(-q.shape[0] * kv.k_fp.shape[1] * num_splits // multiprocessors(q.device))
    zq_ahead = decode_gluon.kernel_options(kernel)["zq_ahead"]
    few = per_sm <= decode_gluon.resident_programs(kv, q.shape[-1], GLUON_MAXNREG_FEW, zq_ahead)
    return GLUON_MAXNREG_FEW if few else GLUON_MAXNREG


def choose_kernel(q: torch.Tensor, kv: PagedKV, num_warps: int = 1) -> str:
    """decode_attention(kernel="auto")'s choice for one-warp programs: for a launch it supports
    (decode_gluon.supports_tma: a Hopper GPU) ROWS_KERNEL where reads_rows (with the device's memory bandwidth),
    else FOLDED_KERNEL where folds_max, else "gluon-tma"; else "gluon" for one the Gluon kernel supports
    (decode_gluon.supports: a GPU, 16-bit queries, tileable pages), else "triton"."""
    from . import decode_gluon
    if num_warps != 1 or not decode_gluon.supports(q, kv):
        return "triton"
    if not decode_gluon.supports_tma(q, kv):
        return "gluon"
    sm_count = multiprocessors(q.device)
    if reads_rows(q, kv, sm_count, device_memory_gbs(q.device)):
        return ROWS_KERNEL
    return FOLDED_KERNEL if folds_max(q, kv, sm_count) else "gluon-tma"


def pages_a_program(q: torch.Tensor, kv: PagedKV, sm_count: int) -> int:
    """Pages that the plain TMA kernel's programs (its split_count at GLUON_MAXNREG on sm_count multiprocessors)
    would walk each, by the page tables' width."""
    pages = max(1, kv.k_table.shape[1])
    return -(-pages // split_count(q, kv, "gluon-tma", GLUON_MAXNREG, sm_count=sm_count))


def folds_max(q: torch.Tensor, kv: PagedKV, sm_count: int) -> bool:
    """Whether pages_a_program is at least FOLD_PAGES: where "auto" takes FOLDED_KERNEL."""
    return pages_a_program(q, kv, sm_count) >= FOLD_PAGES


def reads_rows(q: torch.Tensor, kv: PagedKV, sm_count: int, memory_gbs: float | None = None) -> bool:
    """Whether pages_a_program is at least ROWS_PAGES, the key pages have ROWS_BOOSTED boosted channels and the
    device's memory bandwidth (memory_gbs; None where not known, as before it was measured) is at least
    ROWS_MIN_GBS: where "auto" takes ROWS_KERNEL."""
    fast_memory = memory_gbs is None or memory_gbs >= ROWS_MIN_GBS
    return kv.n_boost == ROWS_BOOSTED and fast_memory and pages_a_program(q, kv, sm_count) >= ROWS_PAGES


def bandwidth_gbs(memory_clock_khz: float, bus_width_bits: int) -> float:
    """A device's memory bandwidth from its memory clock and bus width (double data rate), GB/s: an H100 SXM's
    2,619 MHz and 5,120 bits read 3,352 GB/s."""
    return memory_clock_khz * 1e3 * 2 * bus_width_bits / 8 / 1e9


def device_memory_gbs(device: torch.device) -> float | None:
    """A CUDA device's memory bandwidth by its properties (bandwidth_gbs); None on a CPU or where torch does not
    give its memory clock and bus width."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return bandwidth_gbs(clock, width) if clock and width else None


def decode_attention(q: torch.Tensor, kv: PagedKV, sm_scale: float, num_splits: int | None = None,
                     workspace: DecodeWorkspace | None = None, num_warps: int = 1, num_stages: int = 3,
                     maxnreg: int | None = None, kernel: str = "auto", rest_warps: int | None = None,
                     pdl: bool | None = None, rest_maxnreg: int | None = None,
                     rest_blocks: int | None = None, rest_keys: str | None = None) -> torch.Tensor:
    """q (B, HQ, D) -> (B, HQ, D), equal to decode_attention_ref within float tolerance.
    Three launches (decode_launches): the paged slots' kernel, the remaining blocks' (decode_rest.py: sink, buffers)
    and the merge of their partials. num_splits: programs sharing each (sequence, KV head)'s paged slots (default:
    split_count); num_warps / num_stages: the Triton kernel's warps per program and software-pipelining depth (the
    Gluon kernel's programs are one warp); maxnreg: the paged slots' kernel's register cap per thread (defaults tuned
    on the H200: MAXNREG for Triton, gluon_maxnreg for the Gluon kernel; 255 leaves it to the compiler). kernel: that
    kernel, "triton", "gluon" (kernels/decode_gluon.py, GPU only; launches it cannot take fall back to Triton),
    "gluon-tma" (the same with TMA copies, Hopper only; the same fallback), "gluon-tma-i8k" / "gluon-tma-i8" (the
    same with 8-bit key / key and value products: decode_gluon.supports_kernel; the same fallback) or "auto"
    (choose_kernel); a Gluon kernel's name may add experiments, "+name" each (kernel_parts). rest_warps /
    rest_maxnreg / rest_blocks: warps a program of the remaining blocks (default: decode_rest.rest_warps), their
    register cap (default: decode_rest.rest_maxnreg; 255 leaves it to the compiler) and blocks a program (default:
    decode_rest.rest_blocks_per_program). rest_keys: how the remaining blocks of a key page read its codes, one of
    decode_rest.KEY_READS or "auto" (default REST_KEYS). pdl: the three launches chained by programmatic dependent
    launch (decode_launches; default PDL). With a workspace, its buffers are reused (see DecodeWorkspace); without,
    they are allocated per call."""
    return decode_launches(q, kv, sm_scale, num_splits, workspace, num_warps, num_stages, maxnreg, kernel,
                           rest_warps, pdl, rest_maxnreg, rest_blocks, rest_keys=rest_keys)()


@dataclass
class DecodeLaunches:
    """decode_attention's three launches, each with every setting resolved, so that each can also be timed alone
    (bench attention's parts); calling the whole runs them in order (the remaining blocks first, or with `pdl` the
    paged slots first) and returns `out`, which the merge writes."""
    remaining: Callable[[], None]
    paged: Callable[[], None]
    merge: Callable[[], None]
    out: torch.Tensor
    pdl: bool = False

    def __call__(self) -> torch.Tensor:
        for launch in (self.paged, self.remaining) if self.pdl else (self.remaining, self.paged):
            launch()
        self.merge()
        return self.out


def decode_launches(q: torch.Tensor, kv: PagedKV, sm_scale: float, num_splits: int | None = None,
                    workspace: DecodeWorkspace | None = None, num_warps: int = 1, num_stages: int = 3,
                    maxnreg: int | None = None, kernel: str = "auto", rest_warps: int | None = None,
                    pdl: bool | None = None, rest_maxnreg: int | None = None,
                    rest_blocks: int | None = None, times: tuple | None = None,
                    rest_keys: str | None = None) -> DecodeLaunches:
    """The launches of decode_attention (same arguments): the remaining blocks' kernel, the paged slots' kernel and
    the merge, with the kernel, split, register cap and warps resolved as it resolves them.

    pdl (Hopper and later, compiled; ignored elsewhere): the paged slots' kernel first, then the remaining blocks'
    and the merge, each launched by programmatic dependent launch beside the one before it. The remaining blocks
    read nothing the paged kernel writes: their programs start as soon as every paged program has started (at batch
    1 the GPU is mostly idle then) or, where the paged programs fill the multiprocessors, as they end, and the last
    of them waits for the paged grid before it ends; the merge starts early too and waits for both grids before it
    reads a partial. Why: at batch 1 / 4K a call is three latency-bound launches in a row, 3.8 + 4.8 + 1.7 us and
    about 1 us of gaps, against SDPA's 9.2 (BENCHMARKS.md section 1, session 18).
    times (a measurement, `bench tune --vary timeline`; a Gluon paged kernel only): two int64 buffers, (paged,
    remaining), of decode_rest.TIMES_ROW a program, at least as many rows as each launch's programs, to which
    each program of the paged and of the remaining blocks' launch writes when it started and ended, and where."""
    check_kernel(kernel)                            # a name it does not take: ValueError
    rest_keys = REST_KEYS if rest_keys is None else rest_keys
    if rest_keys not in ("auto", *KEY_READS):
        raise ValueError(f"rest_keys {rest_keys!r}: choose one of auto, {', '.join(KEY_READS)}")
    bsz, hq, d = q.shape
    h = kv.k_fp.shape[1]
    q = q.contiguous()
    if kernel == "auto":
        kernel = choose_kernel(q, kv, num_warps)
    elif is_gluon(kernel):
        from . import decode_gluon
        kernel = kernel if decode_gluon.supports_kernel(kernel, q, kv) else "triton"
    if num_splits is None:
        num_splits = split_count(q, kv, kernel, maxnreg or (GLUON_MAXNREG if is_gluon(kernel) else MAXNREG),
                                 num_warps)
    if maxnreg is None:
        maxnreg = gluon_maxnreg(q, kv, num_splits, kernel) if is_gluon(kernel) else MAXNREG
    if rest_blocks is None:
        rest_blocks = rest_blocks_per_program(bsz * h, rest_parts(kv), multiprocessors(q.device), kv.k_table.shape[1])
    rest = rest_parts(kv, rest_blocks)
    if rest_keys == "auto":
        rest_keys = choose_rest_keys(rest_blocks, bsz * h * rest, multiprocessors(q.device))
    if rest_warps is None:
        rest_warps = default_rest_warps(bsz * h * rest, multiprocessors(q.device))
    if rest_maxnreg is None:
        rest_maxnreg = default_rest_maxnreg(rest_warps, rest_blocks)
    workspace = workspace or DecodeWorkspace()
    parts = workspace.get(q, num_splits + rest)
    qk_scale = sm_scale * math.log2(math.e)
    dot = dot_dtype(q.dtype)
    pdl = (PDL if pdl is None else pdl) and pdl_supported(q.device)

    # Without PDL the remaining blocks go first: at batch 1 they are as long as the paged slots' programs of a
    # 4K-token sequence. (Other ways to run them beside the paged kernel, measured and not kept: on a second stream,
    # 1-3 us faster at three of six shapes and as much slower at the other three; as programs of the Gluon kernel's
    # launch, slower at all six; first, with the paged kernel started beside them by PDL, 2 us slower at batch 1 /
    # 32K: BENCHMARKS.md section 1, sessions 12 to 14.)
    def remaining():
        launch_rest(q, kv, qk_scale, parts[:3], num_splits, dot, precision(dot), rest_warps, pdl, rest_maxnreg,
                    rest_blocks, times[1] if times else None, rest_keys)

    if is_gluon(kernel):
        from . import decode_gluon
        options = decode_gluon.kernel_options(kernel)
        descriptors = workspace.tma_descriptors(kv, d) if options["use_tma"] else None
        query_rows = workspace.query_rows(q, kv) if options["q_rows"] else None

        def paged():
            decode_gluon.launch(q, kv, qk_scale, parts[:3], num_splits, maxnreg, descriptors=descriptors, pdl=pdl,
                                times=times[0] if times else None, query_rows=query_rows, **options)
    elif times:
        raise ValueError(f"times: the paged launch's programs write them in a Gluon kernel, not in {kernel!r}")
    else:
        args, constants = split_kernel_arguments(q, kv, sm_scale, parts[:3], num_splits)

        def paged():
            _decode_split_kernel[(bsz, h, num_splits)](*args, **constants, num_warps=num_warps,
                                                       num_stages=num_stages, PDL=pdl,
                                                       **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
    return DecodeLaunches(remaining, paged, lambda: merge_splits(*parts, pdl=pdl), parts[3], pdl)


def choose_rest_keys(blocks_per_program: int, programs: int, sm_count: int) -> str:
    """rest_keys "auto"'s choice for a launch of the remaining blocks in `programs` programs of blocks_per_program
    blocks each on sm_count multiprocessors: "codes" from CODES_BLOCKS blocks a program, or where there is at most
    one program a multiprocessor (batch 1), else "elements"."""
    return "codes" if blocks_per_program >= CODES_BLOCKS or programs <= sm_count else "elements"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled Triton on a Hopper or later GPU (the interpreter has no
    griddepcontrol)."""
    return device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device)[0] >= 9


def merge_splits(part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor,
                 sm_count: int | None = None, pdl: bool = False) -> torch.Tensor:
    """out (B, HQ, D) = sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M) l_p over the parts p of each row (M: the rows'
    largest m; parts with m = -inf weigh nothing): the split programs' partials (B, HQ, P, D), (B, HQ, P) x 2.
    sm_count: the multiprocessors the merge spreads over (default: the device's); pdl: launched by programmatic
    dependent launch beside the kernel before it (decode_launches' pdl)."""
    bsz, hq, num_parts, d = part_o.shape
    if sm_count is None:
        sm_count = multiprocessors(out.device)
    block_s, block_dc = merge_blocks(bsz * hq, d, sm_count, num_parts)
    _merge_splits_kernel[(bsz * hq, triton.cdiv(d, block_dc))](part_o, part_m, part_l, out, num_parts, D=d,
                                                               BLOCK_S=block_s, BLOCK_DC=block_dc,
                                                               num_warps=MERGE_WARPS,
                                                               **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out
