"""Decode attention of one new query per sequence over [sink | key/value pages | key Q-buffer | value tail].

Flash-decoding: the token range of each (sequence, KV head) is cut into NSPLIT slices of whole G-token blocks;
one program per slice runs an online softmax with all query heads of the KV group in the rows of one tile,
dequantizing pages in registers, and writes a partial (max, sum, output); a second small kernel merges the
slices with log-sum-exp weights. No score tensor and no full-precision copy of the cache reach memory.

Dequantization is folded into the two products (exact algebra, fewer operations per element):
    q . k_t = sum_d (q_d * scale_d) * code_dt + sum_d q_d * zero_d           (keys: per-channel scale / zero)
    sum_t p_t v_t = sum_t (p_t * scale_t) * code_t + sum_t p_t * zero_t      (values: per-token scale / zero)
so the integer codes go straight into the matrix units.
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
    k_pages = dequantize_keys_ref(kv.k_low[kp], kv.k_high[kp], kv.k_idx[kp], kv.k_scale[kp], kv.k_zero[kp],
                                  kv.n_boost, dtype)
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
@triton.jit
def _unpack(packed, shifts):
    """(A, B) bytes -> (A, B, 4) 2-bit codes, code i of a byte at bits 2i."""
    return (packed[:, :, None].to(tl.int32) >> shifts) & 3


# Sizes that grow during generation are not specialized on (Triton would compile a new variant whenever one
# becomes a multiple of 16, stalling a decode step for a second or more).
@triton.jit(do_not_specialize=["CK", "CV", "KMP", "VMP"])
def _decode_split_kernel(
        q_ptr, kfp_ptr, vfp_ptr,
        klow_ptr, khigh_ptr, kidx_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, seqlen_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, CK, CV, KMP, VMP,
        H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        NB: tl.constexpr, V_BITS: tl.constexpr, NSPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_G: tl.constexpr = 4 * BLOCK_G4
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    BLOCK_D4: tl.constexpr = BLOCK_D // 4

    length = tl.load(seqlen_ptr + b)
    nkp = tl.load(nkp_ptr + b)
    nvp = tl.load(nvp_ptr + b)
    sink_len = tl.minimum(length, S)
    n_sink_blocks = tl.cdiv(sink_len, G)
    n_blocks = n_sink_blocks + nkp + tl.cdiv(length - sink_len - nkp * G, G)
    per_split = tl.cdiv(n_blocks, NSPLIT)
    start = split * per_split
    end = tl.minimum(start + per_split, n_blocks)

    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qrow = h * GROUP + rows
    qf = tl.load(q_ptr + (b * H * GROUP + qrow[:, None]).to(tl.int64) * D + d[None, :],
                 mask=(rows < GROUP)[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    q = qf.to(DOT)
    tok = tl.arange(0, BLOCK_G)                         # token slot in a block: 4 * byte + code
    j = tl.arange(0, BLOCK_G4)
    c = tl.arange(0, BLOCK_D4)
    i4 = tl.arange(0, 4)
    shifts = (i4 * 2)[None, None, :]
    kv_head = (b * H + h).to(tl.int64)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for blk in range(start, end):
        in_sink = blk < n_sink_blocks
        page = blk - n_sink_blocks                      # page slot for blocks after the sink
        n_valid = tl.where(in_sink, sink_len - blk * G, tl.where(page < nkp, G, length - S - page * G))
        # ---- scores: key page (dequantized in registers) or full-precision keys
        if (page >= 0) & (page < nkp):
            kpg = tl.load(ktab_ptr + b * KMP + page).to(tl.int64) * H + h
            scale = tl.load(kscale_ptr + kpg * D + d, mask=dmask, other=0.0).to(tl.float32)
            zero = tl.load(kzero_ptr + kpg * D + d, mask=dmask, other=0.0).to(tl.float32)
            bmask = dmask[:, None] & (j < G4)[None, :]
            code = _unpack(tl.load(klow_ptr + kpg * D * G4 + d[:, None] * G4 + j[None, :], mask=bmask, other=0),
                           shifts)
            if NB > 0:
                idx = tl.load(kidx_ptr + kpg * D + d, mask=dmask, other=255).to(tl.int32)
                boosted = idx < NB
                high = tl.load(khigh_ptr + kpg * NB * G4 + tl.where(boosted, idx, 0)[:, None] * G4 + j[None, :],
                               mask=bmask & boosted[:, None], other=0)
                code = code | (_unpack(high, shifts) << 2)
            kt = tl.reshape(code, (BLOCK_D, BLOCK_G)).to(DOT)
            s = tl.dot((qf * scale[None, :]).to(DOT), kt, input_precision=PREC)
            s += tl.sum(qf * zero[None, :], axis=1)[:, None]
        else:
            kbase = tl.where(in_sink, blk * G, S + (page - nkp) * G)
            kt = tl.load(kfp_ptr + (kv_head * CK + kbase + tok[None, :]) * D + d[:, None],
                         mask=dmask[:, None] & (tok < n_valid)[None, :], other=0.0)
            s = tl.dot(q, kt.to(DOT), input_precision=PREC)
        s = tl.where((tok < n_valid)[None, :], s * qk_scale, float("-inf"))
        # ---- online softmax (base 2: qk_scale carries log2(e))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        m_i = m_new
        # ---- values: value page (dequantized in registers) or full-precision values
        if (page >= 0) & (page < nvp):
            vpg = tl.load(vtab_ptr + b * VMP + page).to(tl.int64) * H + h
            vscale = tl.load(vscale_ptr + vpg * G + tok, mask=tok < G, other=0.0).to(tl.float32)
            vzero = tl.load(vzero_ptr + vpg * G + tok, mask=tok < G, other=0.0).to(tl.float32)
            offs = vpg * G * D4 + tok[:, None] * D4 + c[None, :]
            vmask = (tok < G)[:, None] & (c < D4)[None, :]
            code = _unpack(tl.load(vlow_ptr + offs, mask=vmask, other=0), shifts)
            if V_BITS == 4:
                code = code | (_unpack(tl.load(vhigh_ptr + offs, mask=vmask, other=0), shifts) << 2)
            v = tl.reshape(code, (BLOCK_G, BLOCK_D)).to(DOT)
            acc += tl.dot((p * vscale[None, :]).to(DOT), v, input_precision=PREC)
            acc += tl.sum(p * vzero[None, :], axis=1)[:, None]
        else:
            vbase = tl.where(in_sink, blk * G, S + (page - nvp) * G)
            v = tl.load(vfp_ptr + (kv_head * CV + vbase + tok[:, None]) * D + d[None, :],
                        mask=(tok < n_valid)[:, None] & dmask[None, :], other=0.0)
            acc += tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)

    part = (b * H * GROUP + qrow).to(tl.int64) * NSPLIT + split
    rmask = rows < GROUP
    tl.store(pm_ptr + part, m_i, mask=rmask)
    tl.store(pl_ptr + part, l_i, mask=rmask)
    tl.store(po_ptr + part[:, None] * D + d[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _merge_splits_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, D: tl.constexpr, NSPLIT: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                 # one (sequence, query head)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NSPLIT
    m = tl.load(pm_ptr + row * NSPLIT + sp, mask=smask, other=float("-inf"))
    l = tl.load(pl_ptr + row * NSPLIT + sp, mask=smask, other=0.0)
    o = tl.load(po_ptr + (row * NSPLIT + sp[:, None]) * D + d[None, :], mask=smask[:, None] & (d < D)[None, :],
                other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def dot_dtype(dtype: torch.dtype):
    """Operand type of the matrix products: the model's half type on a GPU. Triton's CPU interpreter computes
    bfloat16 arithmetic wrongly (numpy has no bfloat16), so interpreted bfloat16 runs use float32 operands."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpreted:
        return tl.bfloat16
    return tl.float32


def default_splits(batch: int, kv_heads: int, max_blocks: int, sm_count: int = 132) -> int:
    """Enough slices to give every multiprocessor ~2 programs, never more slices than blocks."""
    want = triton.cdiv(2 * sm_count, batch * kv_heads)
    return max(1, min(want, max_blocks, 64))


class DecodeWorkspace:
    """decode_attention's partial results and output, kept between calls of one layer so that a decode step
    allocates nothing (and a captured CUDA graph keeps its addresses). The output returned by a call is
    overwritten by the next call with the same workspace."""

    def __init__(self):
        self.buffers: tuple[torch.Tensor, ...] = ()

    def get(self, q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, ...]:
        bsz, hq, d = q.shape
        out = self.buffers[3] if self.buffers else None
        if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
                or self.buffers[1].shape[2] != num_splits:
            part_o = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
            part_m = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
            self.buffers = (part_o, part_m, torch.empty_like(part_m), torch.empty_like(q))
        return self.buffers


def split_kernel_arguments(q, kv: PagedKV, sm_scale: float, parts) -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _decode_split_kernel for one launch; parts are the
    (output, max, sum) partials, their split count sets NSPLIT. Also used to compile the kernel for a profile."""
    part_o, part_m, part_l = parts
    bsz, hq, d = q.shape
    h, g = kv.k_fp.shape[1], kv.page_size
    args = (q, kv.k_fp, kv.v_fp, kv.k_low, kv.k_high, kv.k_idx, kv.k_scale, kv.k_zero,
            kv.v_low, kv.v_high, kv.v_scale, kv.v_zero, kv.k_table, kv.v_table, kv.seq_len, kv.n_kpages,
            kv.n_vpages, part_o, part_m, part_l, sm_scale * math.log2(math.e), kv.k_fp.shape[2], kv.v_fp.shape[2],
            kv.k_table.shape[1], kv.v_table.shape[1])
    constants = dict(H=h, GROUP=hq // h, D=d, S=kv.sink, G=g, NB=kv.n_boost, V_BITS=kv.v_bits,
                     NSPLIT=part_m.shape[2], DOT=dot_dtype(q.dtype),
                     PREC="ieee" if q.dtype == torch.float32 else "tf32",
                     BLOCK_M=max(16, triton.next_power_of_2(hq // h)), BLOCK_D=triton.next_power_of_2(d),
                     BLOCK_G4=max(4, triton.next_power_of_2(g // 4)))
    return args, constants


def decode_attention(q: torch.Tensor, kv: PagedKV, sm_scale: float, num_splits: int | None = None,
                     workspace: DecodeWorkspace | None = None) -> torch.Tensor:
    """Triton launch: q (B, HQ, D) -> (B, HQ, D), equal to decode_attention_ref within float tolerance.
    With a workspace, its buffers are reused (see DecodeWorkspace); without, they are allocated per call."""
    bsz, hq, d = q.shape
    h = kv.k_fp.shape[1]
    if num_splits is None:
        max_blocks = triton.cdiv(kv.k_fp.shape[2], kv.page_size) + kv.k_table.shape[1] + 1
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = default_splits(bsz, h, max_blocks, sm_count)
    q = q.contiguous()
    part_o, part_m, part_l, out = (workspace or DecodeWorkspace()).get(q, num_splits)
    args, constants = split_kernel_arguments(q, kv, sm_scale, (part_o, part_m, part_l))
    _decode_split_kernel[(bsz, h, num_splits)](*args, **constants, num_warps=4)
    _merge_splits_kernel[(bsz * hq,)](part_o, part_m, part_l, out, D=d, NSPLIT=num_splits,
                                      BLOCK_D=triton.next_power_of_2(d),
                                      BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1)
    return out
