"""Decode attention with the matrix products turned around: tokens (keys) and channels (values) on the rows of the
matrix instruction, the KV group's query heads on its columns (decode_attention's kernel="tokens-m").

The default kernel (decode_attention.py, "heads-m") puts the query heads on the rows. A tensor-core tile has 16
rows but a Qwen3-8B KV group only 4 query heads, so three quarters of its score and output tiles are padding: 4x
the matrix instructions, softmax arithmetic and accumulator registers the data needs (255 registers, 8 one-warp
programs per multiprocessor, latency-bound; BENCHMARKS.md section 1). Here the same products are transposed,

    scores^T (tokens, heads)   = codes_k (tokens, channels) @ (q * scale)^T (channels, heads)
    out^T    (channels, heads) = codes_v (channels, tokens) @ (p * scale)^T (tokens, heads)

so the padded side is the instruction's 8 columns (2x padding for 4 heads, none for 8) and the codes are the
first operand. The page layout is unchanged: a byte tile of a key page is (tokens of a quarter, channels) with
channels contiguous, a value page's (channels of a quarter, tokens) with tokens contiguous, each already the
row-major first operand its product contracts. Same work split, block order, partials and merge as heads-m.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .decode_attention import KC, OFFSET_MAGIC, OFFSET_W1, OFFSET_W2, _program_blocks, _quarters, _quarters_offset


@triton.jit
def _key_page_scores_t(q_cols, hmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, page,
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
        tile = tl.load(klow_ptr + page * (G4 * D) + j[:, None] * D + d[None, :], mask=jmask & dmask[None, :],
                       other=0)                                                 # (token-in-quarter, channel)
        if OFFSET:
            k0, k1, k2, k3 = _quarters_offset(tile, DOT, ASM)
            bsum += tl.sum(b.to(tl.float32), axis=0)                           # the rounded operand the MMA sees
        else:
            k0, k1, k2, k3 = _quarters(tile, DOT, ASM)
        s0 = tl.dot(k0, b, s0, input_precision=PREC)
        s1 = tl.dot(k1, b, s1, input_precision=PREC)
        s2 = tl.dot(k2, b, s2, input_precision=PREC)
        s3 = tl.dot(k3, b, s3, input_precision=PREC)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        r = tl.arange(0, BLOCK_NB)
        nbmask = r < NB
        ch = tl.load(kch_ptr + page * NB + r, mask=nbmask, other=0).to(tl.int32)
        ch_scale = tl.load(kscale_ptr + page * D + ch, mask=nbmask, other=0.0).to(tl.float32)
        q_ch = tl.load(q_cols[None, :] + ch[:, None], mask=nbmask[:, None] & hmask[None, :], other=0.0)
        b = (q_ch.to(tl.float32) * qk_scale * (4.0 * ch_scale)[:, None]).to(DOT)
        tile = tl.load(khigh_ptr + page * (G4 * NB) + j[:, None] * NB + r[None, :], mask=jmask & nbmask[None, :],
                       other=0)
        if OFFSET:
            h0, h1, h2, h3 = _quarters_offset(tile, DOT, ASM)
            bsum += tl.sum(b.to(tl.float32), axis=0)
        else:
            h0, h1, h2, h3 = _quarters(tile, DOT, ASM)
        s0 = tl.dot(h0, b, s0, input_precision=PREC)
        s1 = tl.dot(h1, b, s1, input_precision=PREC)
        s2 = tl.dot(h2, b, s2, input_precision=PREC)
        s3 = tl.dot(h3, b, s3, input_precision=PREC)
    if OFFSET:                                          # s_i = M * bsum + w_i * scores_i
        offset = OFFSET_MAGIC * bsum
        return (s0 + (zq - offset)[None, :], s1 * (1.0 / OFFSET_W1) + (zq - offset / OFFSET_W1)[None, :],
                s2 * (1.0 / OFFSET_W2) + (zq - offset / OFFSET_W2)[None, :], s3 + (zq - offset)[None, :])
    zq = zq[None, :]
    return s0 + zq, s1 + zq, s2 + zq, s3 + zq


@triton.jit
def _fp_key_scores_t(q_cols, hmask, qk_scale, kfp_ptr, row0, n_valid, D: tl.constexpr, G4: tl.constexpr,
                     DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G4: tl.constexpr):
    """Scores (log2 units, (token, head)) of the 4 token quarters of up to 4*G4 full-precision keys from row
    `row0` of k_fp."""
    j = tl.arange(0, BLOCK_G4)
    s0 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s1 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s2 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    s3 = tl.zeros((BLOCK_G4, BLOCK_H), tl.float32)
    for chunk in tl.static_range(0, D, KC):
        d = chunk + tl.arange(0, KC)
        dmask = d < D
        q = tl.load(q_cols[None, :] + d[:, None], mask=dmask[:, None] & hmask[None, :], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT)
        ptrs = kfp_ptr + (row0 + j[:, None]).to(tl.int64) * D + d[None, :]
        mask = (j < G4)[:, None] & dmask[None, :]
        s0 = tl.dot(tl.load(ptrs, mask=mask & (j < n_valid)[:, None], other=0.0).to(DOT), q, s0,
                    input_precision=PREC)
        s1 = tl.dot(tl.load(ptrs + G4 * D, mask=mask & (G4 + j < n_valid)[:, None], other=0.0).to(DOT), q, s1,
                    input_precision=PREC)
        s2 = tl.dot(tl.load(ptrs + 2 * G4 * D, mask=mask & (2 * G4 + j < n_valid)[:, None], other=0.0).to(DOT), q,
                    s2, input_precision=PREC)
        s3 = tl.dot(tl.load(ptrs + 3 * G4 * D, mask=mask & (3 * G4 + j < n_valid)[:, None], other=0.0).to(DOT), q,
                    s3, input_precision=PREC)
    return s0, s1, s2, s3


@triton.jit
def _online_softmax_t(s0, s1, s2, s3, n_valid, m_i, l_i, G4: tl.constexpr, BLOCK_G4: tl.constexpr,
                      MASKED: tl.constexpr):
    """_online_softmax of decode_attention.py over (token, head) tiles: reductions over the rows."""
    if MASKED:
        j = tl.arange(0, BLOCK_G4)
        jmask = (j < G4)[:, None]
        s0 = tl.where(jmask & (j < n_valid)[:, None], s0, float("-inf"))
        s1 = tl.where(jmask & (G4 + j < n_valid)[:, None], s1, float("-inf"))
        s2 = tl.where(jmask & (2 * G4 + j < n_valid)[:, None], s2, float("-inf"))
        s3 = tl.where(jmask & (3 * G4 + j < n_valid)[:, None], s3, float("-inf"))
    m_new = tl.maximum(tl.maximum(tl.maximum(m_i, tl.max(s0, axis=0)), tl.max(s1, axis=0)),
                       tl.maximum(tl.max(s2, axis=0), tl.max(s3, axis=0)))
    alpha = tl.math.exp2(m_i - m_new)
    p0 = tl.math.exp2(s0 - m_new[None, :])
    p1 = tl.math.exp2(s1 - m_new[None, :])
    p2 = tl.math.exp2(s2 - m_new[None, :])
    p3 = tl.math.exp2(s3 - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p0, axis=0) + tl.sum(p1, axis=0) + tl.sum(p2, axis=0) + tl.sum(p3, axis=0)
    return p0, p1, p2, p3, alpha, m_new, l_i


@triton.jit
def _value_quarter_t(p, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, page,
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
    offs = page * (D4 * G) + c[:, None] * G + tok[None, :]                    # (channel byte, token), tokens contiguous
    mask = (c < D4)[:, None] & jmask[None, :]
    if OFFSET:
        v0, v1, v2, v3 = _quarters_offset(tl.load(vlow_ptr + offs, mask=mask, other=0), DOT, ASM)
        pacc += tl.sum(b.to(tl.float32), axis=0) * (5.0 if V_BITS == 4 else 1.0)   # the high plane's is 4x
    else:
        v0, v1, v2, v3 = _quarters(tl.load(vlow_ptr + offs, mask=mask, other=0), DOT, ASM)
    acc0 = tl.dot(v0, b, acc0, input_precision=PREC)
    acc1 = tl.dot(v1, b, acc1, input_precision=PREC)
    acc2 = tl.dot(v2, b, acc2, input_precision=PREC)
    acc3 = tl.dot(v3, b, acc3, input_precision=PREC)
    if V_BITS == 4:
        b = (b.to(tl.float32) * 4.0).to(DOT)                                   # exact: the high bits weigh 4
        if OFFSET:
            v0, v1, v2, v3 = _quarters_offset(tl.load(vhigh_ptr + offs, mask=mask, other=0), DOT, ASM)
        else:
            v0, v1, v2, v3 = _quarters(tl.load(vhigh_ptr + offs, mask=mask, other=0), DOT, ASM)
        acc0 = tl.dot(v0, b, acc0, input_precision=PREC)
        acc1 = tl.dot(v1, b, acc1, input_precision=PREC)
        acc2 = tl.dot(v2, b, acc2, input_precision=PREC)
        acc3 = tl.dot(v3, b, acc3, input_precision=PREC)
    return acc0, acc1, acc2, acc3, zacc, pacc


@triton.jit
def _fp_value_quarter_t(p, acc0, acc1, acc2, acc3, vfp_ptr, row0, n_valid, quarter: tl.constexpr, D: tl.constexpr,
                        G4: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, OFFSET: tl.constexpr,
                        BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr):
    """Accumulate token quarter `quarter` of up to 4*G4 full-precision values from row `row0` of v_fp. OFFSET:
    channel quarter i's accumulator holds w_i * output (see _value_quarter_t), so these terms are scaled alike
    (by a power of 2: exact)."""
    D4: tl.constexpr = D // 4
    j = tl.arange(0, BLOCK_G4)
    c = tl.arange(0, BLOCK_D4)
    tok = quarter * G4 + j
    ptrs = vfp_ptr + (row0 + tok[None, :]).to(tl.int64) * D + c[:, None]       # (channel, token)
    mask = (c < D4)[:, None] & ((tok < n_valid) & (j < G4))[None, :]
    pd = p.to(DOT)
    pd1, pd2 = pd, pd
    if OFFSET:
        pd1, pd2 = (p * OFFSET_W1).to(DOT), (p * OFFSET_W2).to(DOT)
    acc0 = tl.dot(tl.load(ptrs, mask=mask, other=0.0).to(DOT), pd, acc0, input_precision=PREC)
    acc1 = tl.dot(tl.load(ptrs + D4, mask=mask, other=0.0).to(DOT), pd1, acc1, input_precision=PREC)
    acc2 = tl.dot(tl.load(ptrs + 2 * D4, mask=mask, other=0.0).to(DOT), pd2, acc2, input_precision=PREC)
    acc3 = tl.dot(tl.load(ptrs + 3 * D4, mask=mask, other=0.0).to(DOT), pd, acc3, input_precision=PREC)
    return acc0, acc1, acc2, acc3


@triton.jit
def _value_page_t(p0, p1, p2, p3, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
                  vpage, G: tl.constexpr, D4: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr,
                  PREC: tl.constexpr, ASM: tl.constexpr, OFFSET: tl.constexpr, BLOCK_G4: tl.constexpr,
                  BLOCK_D4: tl.constexpr):
    """All 4 token quarters of value page `vpage`."""
    acc0, acc1, acc2, acc3, zacc, pacc = _value_quarter_t(p0, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 0, G, D4, V_BITS, DOT, PREC,
                                                          ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc, pacc = _value_quarter_t(p1, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 1, G, D4, V_BITS, DOT, PREC,
                                                          ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc, pacc = _value_quarter_t(p2, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 2, G, D4, V_BITS, DOT, PREC,
                                                          ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    acc0, acc1, acc2, acc3, zacc, pacc = _value_quarter_t(p3, acc0, acc1, acc2, acc3, zacc, pacc, vlow_ptr, vhigh_ptr,
                                                          vscale_ptr, vzero_ptr, vpage, 3, G, D4, V_BITS, DOT, PREC,
                                                          ASM, OFFSET, BLOCK_G4, BLOCK_D4)
    return acc0, acc1, acc2, acc3, zacc, pacc


# Sizes that grow during generation are not specialized on (as for decode_attention's kernel).
@triton.jit(do_not_specialize=["CK", "CV", "KMP", "VMP", "NSPLIT", "NPART"])
def _decode_tokens_m_kernel(
        q_ptr, kfp_ptr, vfp_ptr,
        klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, seqlen_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, CK, CV, KMP, VMP, NSPLIT, NPART,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        NB: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
        OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D4: tl.constexpr,
        BLOCK_NB: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    start, end, rest, n_rest, n_sink_blocks, sink_len, n_paged, length, nkp, nvp = _program_blocks(
        seqlen_ptr, nkp_ptr, nvp_ptr, b, part, NSPLIT, S, G)

    heads = tl.arange(0, BLOCK_M)                        # BLOCK_M: the query heads of the group, padded
    hmask = heads < GROUP
    q_cols = q_ptr + (b * H * GROUP + h * GROUP + heads).to(tl.int64) * D
    kv_head = (b * H + h).to(tl.int64)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    zacc = tl.zeros((BLOCK_M,), tl.float32)
    pacc = tl.zeros((BLOCK_M,), tl.float32)         # OFFSET: the sum the value accumulators hold M times
    acc0 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc1 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc2 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)
    acc3 = tl.zeros((BLOCK_D4, BLOCK_M), tl.float32)

    for slot in range(start, end):                      # both pages quantized: no branch in the loop body
        kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
        vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
        s0, s1, s2, s3 = _key_page_scores_t(q_cols, hmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                            kzero_ptr, kpage, D, G4, NB, DOT, PREC, ASM, OFFSET, BLOCK_M, BLOCK_G4,
                                            BLOCK_NB)
        p0, p1, p2, p3, alpha, m_i, l_i = _online_softmax_t(s0, s1, s2, s3, G, m_i, l_i, G4, BLOCK_G4,
                                                            BLOCK_G4 != G4)
        alpha_row = alpha[None, :]
        acc0, acc1, acc2, acc3 = acc0 * alpha_row, acc1 * alpha_row, acc2 * alpha_row, acc3 * alpha_row
        zacc, pacc = zacc * alpha, pacc * alpha
        acc0, acc1, acc2, acc3, zacc, pacc = _value_page_t(p0, p1, p2, p3, acc0, acc1, acc2, acc3, zacc, pacc,
                                                           vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, vpage, G, D4,
                                                           V_BITS, DOT, PREC, ASM, OFFSET, BLOCK_G4, BLOCK_D4)

    for blk in range(rest, tl.minimum(rest + 1, n_rest)):   # at most one remaining block per program
        in_sink = blk < n_sink_blocks
        slot = blk - n_sink_blocks + n_paged
        n_valid = tl.where(in_sink, sink_len - blk * G, tl.minimum(G, length - S - slot * G))
        if (blk >= n_sink_blocks) & (slot < nkp):
            kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
            s0, s1, s2, s3 = _key_page_scores_t(q_cols, hmask, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                                kzero_ptr, kpage, D, G4, NB, DOT, PREC, ASM, OFFSET, BLOCK_M,
                                                BLOCK_G4, BLOCK_NB)
        else:
            row0 = tl.where(in_sink, blk * G, S + (slot - nkp) * G)
            s0, s1, s2, s3 = _fp_key_scores_t(q_cols, hmask, qk_scale, kfp_ptr + kv_head * CK * D, row0, n_valid,
                                              D, G4, DOT, PREC, BLOCK_M, BLOCK_G4)
        # a program with a remaining block has no paged ones (_program_blocks): nothing accumulated to rescale
        p0, p1, p2, p3, alpha, m_i, l_i = _online_softmax_t(s0, s1, s2, s3, n_valid, m_i, l_i, G4, BLOCK_G4, True)
        if (blk >= n_sink_blocks) & (slot < nvp):
            vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
            acc0, acc1, acc2, acc3, zacc, pacc = _value_page_t(p0, p1, p2, p3, acc0, acc1, acc2, acc3, zacc, pacc,
                                                               vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, vpage, G,
                                                               D4, V_BITS, DOT, PREC, ASM, OFFSET, BLOCK_G4,
                                                               BLOCK_D4)
        else:
            row0 = tl.where(in_sink, blk * G, S + (slot - nvp) * G)
            vfp = vfp_ptr + kv_head * CV * D
            acc0, acc1, acc2, acc3 = _fp_value_quarter_t(p0, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 0, D, G4,
                                                         DOT, PREC, OFFSET, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter_t(p1, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 1, D, G4,
                                                         DOT, PREC, OFFSET, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter_t(p2, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 2, D, G4,
                                                         DOT, PREC, OFFSET, BLOCK_G4, BLOCK_D4)
            acc0, acc1, acc2, acc3 = _fp_value_quarter_t(p3, acc0, acc1, acc2, acc3, vfp, row0, n_valid, 3, D, G4,
                                                         DOT, PREC, OFFSET, BLOCK_G4, BLOCK_D4)

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
