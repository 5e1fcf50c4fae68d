"""Decode attention's paged slots in Gluon: the page codes become tensor-core operands without leaving registers.

The Triton kernel (decode_attention.py) loads a tile of code bytes in a layout Triton picks, unpacks it and hands
it to tl.dot, which moves it through shared memory into the matrix unit's operand layout (about 2,400 SASS
instructions per page). Here the layouts are explicit (Gluon), and the page layout is read as it is:

- The contraction over a tile's columns (channels of a key page, tokens of a value page) does not care in which
  order the columns are summed, as long as both operands use the same order. Each thread loads a row's bytes in
  one contiguous run (K/4 bytes: 16-byte loads) and those bytes are declared to BE the columns the mma.sync
  fragment gives that thread: column k' = 16t + 8h + 2c + e of the operand is byte 4t + 2h + e of thread c's run
  (`_operand_order`, a reshape and a permute that `convert_layout(..., assert_trivial=True)` proves cost nothing).
  The other operand (queries times scales, or probabilities times scales) gets the same order the same way.
- A 32-bit word of codes becomes the bf16 operands of 4 quarters with one lop3 per pair (`unpack_asm`, shared
  with the Triton kernel), and the scale / zero / magic-number algebra is the Triton kernel's (see its docstring).
- Scores leave the key product as (token, head) accumulator tiles; the probabilities go to the value product's
  (token, head) operand through one layout conversion per page (the only shared-memory use).

One warp per program, as in the Triton kernel, with the same split of paged slots over NSPLIT programs per
(sequence, KV head) and the same partial outputs; the Triton kernel runs the remaining blocks (sink, buffers) in a
second launch and the same merge combines both. No CPU interpreter runs Gluon: `decode_attention(...,
kernel="gluon")` is tested on a GPU against the PyTorch reference (tests/test_kernels.py), and its static profile
comes from `python -m kernels.sass_profile --kernel gluon`.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .decode_attention import (OFFSET_MAGIC, OFFSET_W1, OFFSET_W2, UNPACK_BF16_OFFSET, UNPACK_FP16)
from .layout import PagedKV

HEADS_PER_TILE = 8          # the matrix instruction's columns: a KV group of up to 8 query heads


def supports(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether the Gluon kernel handles this launch: a CUDA device of compute capability 8.0 or later (mma.sync),
    16-bit queries, a KV group of at most 8 heads, and page shapes that tile into 16 x 16 operands."""
    bsz, hq, d = q.shape
    h, g = kv.k_fp.shape[1], kv.page_size
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8
            and q.dtype in (torch.bfloat16, torch.float16) and hq // h <= HEADS_PER_TILE
            and d % 64 == 0 and g % 64 == 0 and kv.n_boost % 16 == 0)


@gluon.constexpr_function
def _rows_layout(K):
    """A (rows, K) byte tile: thread (r, c) = (lane / 4, lane % 4) holds K/4 contiguous bytes of rows r + 8i."""
    return gl.BlockedLayout([1, K // 4], [8, 4], [1, 1], [1, 0])


@gluon.constexpr_function
def _cols_layout(K):
    """A (K, heads) operand: thread (c, n) = (lane % 4, lane / 4) holds K/4 contiguous rows of head n."""
    return gl.BlockedLayout([K // 4, 1], [4, 8], [1, 1], [0, 1])


@gluon.constexpr_function
def _mma():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.jit
def _a_operand(x, R: gl.constexpr, K: gl.constexpr):
    """(R, K) tile in _rows_layout(K) -> the same registers as the first mma operand, columns in operand order."""
    x = gl.permute(gl.reshape(x, [R, 4, K // 16, 2, 2]), [0, 2, 3, 1, 4])
    return gl.convert_layout(gl.reshape(x, [R, K]), gl.DotOperandLayout(0, _mma(), 2), assert_trivial=True)


@gluon.jit
def _b_operand(x, K: gl.constexpr):
    """(K, heads) tile in _cols_layout(K) -> the same registers as the second mma operand, rows in operand
    order (the order _a_operand gives the first operand's columns)."""
    x = gl.permute(gl.reshape(x, [4, K // 16, 2, 2, HEADS]), [1, 2, 0, 3, 4])
    return gl.convert_layout(gl.reshape(x, [K, HEADS]), gl.DotOperandLayout(1, _mma(), 2), assert_trivial=True)


HEADS = gl.constexpr(HEADS_PER_TILE)


@gluon.jit
def _unpacked(ptr, R: gl.constexpr, K: gl.constexpr, OFFSET: gl.constexpr):
    """The (R, K) byte tile at ptr (rows of K contiguous bytes) -> its four 2-bit fields (quarter i = bits 2i) as
    first mma operands: exact codes (fp16), or M + w_i * code (bf16, OFFSET; see the Triton kernel)."""
    layout: gl.constexpr = _rows_layout(K)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    k = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    x = gl.load(ptr + r[:, None] * K + k[None, :])
    if OFFSET:
        c0, c1, c2, c3 = gl.inline_asm_elementwise(asm=UNPACK_BF16_OFFSET, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
                                                   args=[x], dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                   is_pure=True, pack=4)
    else:
        c0, c1, c2, c3 = gl.inline_asm_elementwise(asm=UNPACK_FP16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
                                                   args=[x], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                   is_pure=True, pack=4)
    return _a_operand(c0, R, K), _a_operand(c1, R, K), _a_operand(c2, R, K), _a_operand(c3, R, K)


@gluon.jit
def _products(a0, a1, a2, a3, b, acc0, acc1, acc2, acc3):
    return mma_v2(a0, b, acc0), mma_v2(a1, b, acc1), mma_v2(a2, b, acc2), mma_v2(a3, b, acc3)


@gluon.jit
def _heads_vector(x):
    """A per-head vector of a _cols_layout tile's reduction -> the accumulators' head layout."""
    return gl.convert_layout(x, gl.SliceLayout(0, _mma()))


@gluon.jit
def _key_scores(q_b, q_rows, hmask_b, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, kpage,
                D: gl.constexpr, G4: gl.constexpr, NB: gl.constexpr, DOT: gl.constexpr, OFFSET: gl.constexpr):
    """Scores (log2 units) of the 4 token quarters of key page `kpage`, (G4 tokens, HEADS) accumulator tiles.
    q_b: the group's queries times qk_scale, (D, HEADS) in _cols_layout(D); q_rows / hmask_b: (1, HEADS)
    pointers to the query rows and the real heads, for the boosted channels' gather."""
    lay: gl.constexpr = _cols_layout(D)
    d = gl.arange(0, D, layout=gl.SliceLayout(1, lay))
    scale = gl.load(kscale_ptr + kpage * D + d).to(gl.float32)
    zero = gl.load(kzero_ptr + kpage * D + d).to(gl.float32)
    zq = _heads_vector(gl.sum(q_b * zero[:, None], axis=0))
    b = _b_operand((q_b * scale[:, None]).to(DOT), D)
    # OFFSET: every accumulator starts at -M * (the column sums of b), so that M + w_i * code leaves w_i * scores
    init = _offset(gl.zeros([G4, HEADS], gl.float32, _mma()), b, G4, D, DOT, OFFSET)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        lay_nb: gl.constexpr = _cols_layout(NB)
        r = gl.arange(0, NB, layout=gl.SliceLayout(1, lay_nb))
        ch = gl.load(kch_ptr + kpage * NB + r).to(gl.int32)
        ch_scale = gl.load(kscale_ptr + kpage * D + ch).to(gl.float32)
        q_ch = gl.load(gl.convert_layout(q_rows, lay_nb) + ch[:, None], mask=gl.convert_layout(hmask_b, lay_nb),
                       other=0.0)
        b_nb = _b_operand((q_ch.to(gl.float32) * qk_scale * (4.0 * ch_scale)[:, None]).to(DOT), NB)
        init = _offset(init, b_nb, G4, NB, DOT, OFFSET)
        a0, a1, a2, a3 = _unpacked(khigh_ptr + kpage * (G4 * NB), G4, NB, OFFSET)
        init0, init1, init2, init3 = _products(a0, a1, a2, a3, b_nb, init, init, init, init)
    else:
        init0, init1, init2, init3 = init, init, init, init
    a0, a1, a2, a3 = _unpacked(klow_ptr + kpage * (G4 * D), G4, D, OFFSET)
    s0, s1, s2, s3 = _products(a0, a1, a2, a3, b, init0, init1, init2, init3)
    zq = zq[None, :]
    if OFFSET:                                          # s_i = w_i * scores_i
        return s0 + zq, s1 * (1.0 / OFFSET_W1) + zq, s2 * (1.0 / OFFSET_W2) + zq, s3 + zq
    return s0 + zq, s1 + zq, s2 + zq, s3 + zq


@gluon.jit
def _offset(acc, b, R: gl.constexpr, K: gl.constexpr, DOT: gl.constexpr, OFFSET: gl.constexpr):
    """acc - M * (b's column sums) on every row (OFFSET; acc unchanged otherwise): one product with a constant
    operand, cheaper than summing b's rounded values on the side."""
    if OFFSET:
        acc = mma_v2(gl.full([R, K], -OFFSET_MAGIC, DOT, gl.DotOperandLayout(0, _mma(), 2)), b, acc)
    return acc


@gluon.jit
def _token_rows(p0, p1, p2, p3, G: gl.constexpr):
    """The 4 quarters' (G/4, HEADS) probability tiles -> one (G, HEADS) tile in _cols_layout(G), token t = 32i + j
    (the value page's token order)."""
    p = gl.join(gl.join(p0, p1), gl.join(p2, p3))                  # [j, n, b, a] = quarter 2a + b
    p = gl.reshape(gl.permute(p, [3, 2, 0, 1]), [G, HEADS])
    return gl.convert_layout(p, _cols_layout(G))


@gluon.jit(do_not_specialize=["KMP", "VMP", "NSPLIT", "NPART"])
def _gluon_paged_kernel(
        q_ptr, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, KMP, VMP, NSPLIT, NPART,
        H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr,
        V_BITS: gl.constexpr, DOT: gl.constexpr, OFFSET: gl.constexpr):
    """Program (b, h, part < NSPLIT): the paged slots [start, end) of sequence b, KV head h (the Triton kernel's
    _program_blocks split), written as partial (output, max, sum) number `part`."""
    b = gl.program_id(0)
    h = gl.program_id(1)
    part = gl.program_id(2)
    G4: gl.constexpr = G // 4
    D4: gl.constexpr = D // 4
    n_paged = gl.minimum(gl.load(nkp_ptr + b), gl.load(nvp_ptr + b))
    per_split = gl.cdiv(n_paged, NSPLIT)
    start = part * per_split
    end = gl.minimum(start + per_split, n_paged)

    # the group's queries, (D, HEADS) in _cols_layout(D), times qk_scale; heads past the group are zero
    lay_q: gl.constexpr = _cols_layout(D)
    heads_q = gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay_q))
    d = gl.arange(0, D, layout=gl.SliceLayout(1, lay_q))
    q_rows = q_ptr + ((b * H + h) * GROUP + heads_q[None, :]).to(gl.int64) * D
    hmask_b = heads_q[None, :] < GROUP
    q_b = gl.load(q_rows + d[:, None], mask=hmask_b, other=0.0).to(gl.float32) * qk_scale

    lay_v: gl.constexpr = _cols_layout(G)
    t = gl.arange(0, G, layout=gl.SliceLayout(1, lay_v))
    mma: gl.constexpr = _mma()
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, mma))
    zacc = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, lay_v))
    acc0 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc1 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc2 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc3 = gl.zeros([D4, HEADS], gl.float32, mma)
    for slot in range(start, end):
        kpage = gl.load(ktab_ptr + b * KMP + slot).to(gl.int64) * H + h
        vpage = gl.load(vtab_ptr + b * VMP + slot).to(gl.int64) * H + h
        s0, s1, s2, s3 = _key_scores(q_b, q_rows, hmask_b, qk_scale, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                     kzero_ptr, kpage, D, G4, NB, DOT, OFFSET)
        # online softmax over the page's 4 quarters (full pages: no token masked)
        m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), axis=0))
        alpha = gl.exp2(m_i - m_new)
        p0 = gl.exp2(s0 - m_new[None, :])
        p1 = gl.exp2(s1 - m_new[None, :])
        p2 = gl.exp2(s2 - m_new[None, :])
        p3 = gl.exp2(s3 - m_new[None, :])
        l_i = l_i * alpha + gl.sum((p0 + p1) + (p2 + p3), axis=0)
        m_i = m_new
        # values: out^T (channel, head) += codes (channel, token) @ (p * scale) (token, head)
        p = _token_rows(p0, p1, p2, p3, G)
        vscale = gl.load(vscale_ptr + vpage * G + t).to(gl.float32)
        vzero = gl.load(vzero_ptr + vpage * G + t).to(gl.float32)
        alpha_v = gl.convert_layout(alpha, gl.SliceLayout(0, lay_v))
        zacc = zacc * alpha_v + gl.sum(p * vzero[:, None], axis=0)
        pv = _b_operand((p * vscale[:, None]).to(DOT), G)
        alpha_row = alpha[None, :]
        # OFFSET: the page's -M * (column sums of pv) on every row, so that M + w_i * code leaves w_i * p v
        init = _offset(gl.zeros([D4, HEADS], gl.float32, mma), pv, D4, G, DOT, OFFSET)
        if V_BITS == 4:
            pv4 = _b_operand((p * (4.0 * vscale)[:, None]).to(DOT), G)          # the high bits weigh 4
            init = _offset(init, pv4, D4, G, DOT, OFFSET)
            a0, a1, a2, a3 = _unpacked(vhigh_ptr + vpage * (D4 * G), D4, G, OFFSET)
            acc0, acc1, acc2, acc3 = _products(a0, a1, a2, a3, pv4, acc0 * alpha_row + init,
                                               acc1 * alpha_row + init, acc2 * alpha_row + init,
                                               acc3 * alpha_row + init)
        else:
            acc0, acc1, acc2, acc3 = (acc0 * alpha_row + init, acc1 * alpha_row + init, acc2 * alpha_row + init,
                                      acc3 * alpha_row + init)
        a0, a1, a2, a3 = _unpacked(vlow_ptr + vpage * (D4 * G), D4, G, OFFSET)
        acc0, acc1, acc2, acc3 = _products(a0, a1, a2, a3, pv, acc0, acc1, acc2, acc3)

    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
    hmask = heads < GROUP
    idx = ((b * H + h) * GROUP + heads).to(gl.int64) * NPART + part
    gl.store(pm_ptr + idx, m_i, mask=hmask)
    gl.store(pl_ptr + idx, l_i, mask=hmask)
    c = gl.arange(0, D4, layout=gl.SliceLayout(1, mma))
    out = po_ptr + idx[None, :] * D + c[:, None]
    omask = (c < D4)[:, None] & hmask[None, :]
    zrow = _heads_vector(zacc)[None, :]
    if OFFSET:                                          # acc_i = w_i * output
        gl.store(out, acc0 + zrow, mask=omask)
        gl.store(out + D4, acc1 * (1.0 / OFFSET_W1) + zrow, mask=omask)
        gl.store(out + 2 * D4, acc2 * (1.0 / OFFSET_W2) + zrow, mask=omask)
    else:
        gl.store(out, acc0 + zrow, mask=omask)
        gl.store(out + D4, acc1 + zrow, mask=omask)
        gl.store(out + 2 * D4, acc2 + zrow, mask=omask)
    gl.store(out + 3 * D4, acc3 + zrow, mask=omask)


def kernel_arguments(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, num_splits: int) -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _gluon_paged_kernel: programs (b, h, part < num_splits) of
    decode_attention's split, q (B, HQ, D), qk_scale = sm_scale * log2(e), parts the (output, max, sum) partials.
    Also used to compile the kernel for a profile (kernels.sass_profile)."""
    part_o, part_m, part_l = parts
    hq, d = q.shape[1:]
    h = kv.k_fp.shape[1]
    args = (q, kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero, kv.v_low, kv.v_high, kv.v_scale, kv.v_zero,
            kv.k_table, kv.v_table, kv.n_kpages, kv.n_vpages, part_o, part_m, part_l, qk_scale,
            kv.k_table.shape[1], kv.v_table.shape[1], num_splits, part_m.shape[2])
    constants = dict(H=h, GROUP=hq // h, D=d, G=kv.page_size, NB=kv.n_boost, V_BITS=kv.v_bits,
                     DOT=gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16, OFFSET=q.dtype == torch.bfloat16)
    return args, constants


def launch(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, num_splits: int, maxnreg: int) -> None:
    """Run _gluon_paged_kernel (see kernel_arguments) with a register cap per thread (255: the compiler's)."""
    args, constants = kernel_arguments(q, kv, qk_scale, parts, num_splits)
    _gluon_paged_kernel[(q.shape[0], kv.k_fp.shape[1], num_splits)](
        *args, **constants, num_warps=1, **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
