"""The remaining blocks of decode attention (decode_rest.py's: the sink, a key page whose values are still 16-bit,
the buffers) in Gluon, with the query heads on the matrix products' columns as in the paged kernel (decode_gluon.py).

Why: decode_rest.py's Triton kernel puts the KV group's heads on the rows of its products (tl.dot needs 16 of them
for a group of 4) and moves every tile through shared memory into the operand layouts Triton picks: a block of 32
tokens costs its 2-warp programs about 900 instructions a warp of 16-bit rows and 1,600 of a key page (kernels.
sass_profile --kernel rest --blocks), 3-5x the paged kernel's instructions a token. Beside a long paged launch on
the H200, which is bound by the multiprocessors' instructions, the remaining blocks' launch added about 15 us to a
kitty-pro call at batch 64 / 32K (BENCHMARKS.md section 1, sessions 36-39). Here a program is one warp and a block
of T = G/4 tokens is one token quarter of a page (pages of 128: 32 tokens, decode_rest's blocks, numbered as there):
- scores^T (tokens, heads) = keys (tokens, channels) @ queries^T (channels, heads). A key page's block is one 2-bit
  field of every byte of its planes (FIELD_ASM, 3 integer instructions a word of 4 codes), the paged kernel's
  operands (code * 4^i * 2^-24 in fp16, the page's scales on the queries, the zero term apart); 16-bit rows are
  loaded straight into the first operand's registers in the same column order (_a_operand), 16 bytes a load.
- out^T (channels, heads) += values^T (channels, tokens) @ p (tokens, heads): 16-bit value rows go to shared
  memory by cp.async and come back transposed into the first operand (ldmatrix); a value page's block is its token
  quarter, its 4 channel quarters' fields against p times the tokens' scales (the paged kernel's value products).
- The online softmax, the partial (output, max, sum) and the block order (runs or strided, BPP blocks a program) are
  decode_rest's, so the same merge combines them.
Pages of 128 only (a block is then a token quarter): other page sizes, and what decode_gluon.supports does not take,
keep decode_rest.py's kernel (decode_attention's rest_kernel). No CPU interpreter runs Gluon: the kernel is compiled
for sm_90 on the CPU (tests/test_kernels.py) and tested on a GPU against the PyTorch reference.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import decode_gluon
from .decode_gluon import (_BARRIER, DOT, HEADS, KC, PAD_HEAD_MAX, Q_SCALE, _a_operand, _b_operand, _chunk,
                           _cols_layout, _globaltimer, _launch_dependents, _mma, _mul2, _rows_layout, _smid)
from .decode_rest import BLOCK_ORDERS, TIMES_ROW, rest_block_tokens, rest_parts
from .layout import PagedKV

# One 2-bit field of every byte of a word ($2) as the fp16 operands of the paged kernel's unpacking: the field left
# in place, every other bit cleared, is the subnormal number code * 4^i * 2^-24. $3 holds the field's mask in each of
# its 4 bytes (3 << 2i: the field a run-time choice, a block's token quarter). Bytes 0 and 2 go to $0, bytes 1 and 3
# (moved down by a byte permute) to $1: the pairing that layout.SWAP stores the planes for, as decode_gluon's
# SPREAD and QUARTER_ASM pair them, so the second operands are decode_gluon's (_b_operand).
FIELD_ASM = gl.constexpr("{ .reg .b32 t, u; prmt.b32 u, $2, 0, 0x4341; and.b32 t, $2, $3; "
                         "and.b32 $0, t, 0x00ff00ff; and.b32 $1, u, $3; }")


def supports(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether this kernel takes the remaining blocks of this launch: a GPU with mma.sync (decode_gluon.supports)
    and the shapes takes_shapes names."""
    return decode_gluon.supports(q, kv) and takes_shapes(q, kv)


def takes_shapes(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether this kernel takes this launch's shapes, whatever the device: the Gluon paged kernel's
    (decode_gluon.takes_shapes), pages whose token quarter is one of decode_rest's blocks (pages of 128), and
    queries of the 16-bit rows' type (their products' second operand)."""
    return (decode_gluon.takes_shapes("gluon", q, kv) and kv.page_size // 4 == rest_block_tokens(kv.page_size)
            and q.dtype == kv.k_fp.dtype == kv.v_fp.dtype)


@gluon.jit
def _field(x, mask):
    """The (R, K) byte tile x's 2-bit field that `mask` (a byte tile, 3 << 2i) selects, as fp16 operands code * 4^i *
    2^-24 (FIELD_ASM), in x's layout."""
    return gl.inline_asm_elementwise(asm=FIELD_ASM, constraints="=r,=r,r,r", args=[x, mask], dtype=DOT,
                                     is_pure=True, pack=4)


@gluon.jit
def _block_exists(j, n_sink, sink_len, n_paged, length, S: gl.constexpr, G: gl.constexpr, T: gl.constexpr):
    """Whether block j (decode_rest's numbering) holds a token of the sequence."""
    PIECES: gl.constexpr = G // T
    u = gl.maximum(j - n_sink, 0)
    first = (u % PIECES) * T
    return gl.where(j < n_sink, j * T < sink_len, S + (n_paged + u // PIECES) * G + first < length)


@gluon.jit
def _page_scores(kpage, quarter, q16, q_rows, live, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
                 D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr):
    """Token quarter `quarter` of key page kpage (a page and head row of the planes): (G/4 tokens, HEADS) sums of
    q * Q_SCALE . key in units of 2^-24 / 4^quarter, the zero term sum_d q_d * Q_SCALE * zero_d included. q16: the
    group's queries times Q_SCALE and live, fp16 chunks (KC, HEADS) in _cols_layout(KC); q_rows / live: the boosted
    channels' gather (decode_gluon._boosted_fp16's). The zero term is a product too, of q * zero (fp16, as the paged
    kernel rounds it) with a first operand of 4^quarter * 2^-24 everywhere (field `quarter` of bytes 0x55, which is
    1): so it lands in the codes' units and every row, and no fp32 sum over lanes is needed."""
    G4: gl.constexpr = G // 4
    mma: gl.constexpr = _mma()
    cols: gl.constexpr = _cols_layout(KC)
    vec: gl.constexpr = gl.SliceLayout(1, cols)
    rows: gl.constexpr = _rows_layout(KC)
    r = gl.arange(0, G4, layout=gl.SliceLayout(1, rows))[:, None]
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, rows))[None, :]
    mask = gl.full([G4, KC], 3, gl.uint8, rows) << (2 * quarter).to(gl.uint8)
    ones = _a_operand(_field(gl.full([G4, KC], 0x55, gl.uint8, rows), mask), G4, KC)
    d = gl.arange(0, KC, layout=vec)
    s = gl.zeros([G4, HEADS], gl.float32, mma)
    for c in gl.static_range(D // KC):
        # the plane is stored chunk by chunk (layout.py): chunk c is G4 rows of KC bytes
        x = gl.load(klow_ptr + kpage * (G4 * D) + c * (G4 * KC) + r * KC + k)
        scale = gl.load(kscale_ptr + kpage * D + c * KC + d)
        zero = gl.load(kzero_ptr + kpage * D + c * KC + d)
        s = mma_v2(ones, _b_operand(_mul2(q16[c], zero[:, None]), KC), s)
        s = mma_v2(_a_operand(_field(x, mask), G4, KC), _b_operand(_mul2(q16[c], scale[:, None]), KC), s)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        NBC: gl.constexpr = _chunk(NB)
        hrows: gl.constexpr = _rows_layout(NBC)
        hcols: gl.constexpr = _cols_layout(NBC)
        rh = gl.arange(0, G4, layout=gl.SliceLayout(1, hrows))[:, None]
        kh = gl.arange(0, NBC, layout=gl.SliceLayout(0, hrows))[None, :]
        hmask = gl.full([G4, NBC], 3, gl.uint8, hrows) << (2 * quarter).to(gl.uint8)
        n = gl.arange(0, NBC, layout=gl.SliceLayout(1, hcols))
        for c in gl.static_range(NB // NBC):
            ch = gl.load(kch_ptr + kpage * NB + c * NBC + n).to(gl.int32)
            ch_scale = gl.load(kscale_ptr + kpage * D + ch).to(gl.float32)
            q_ch = gl.load(gl.convert_layout(q_rows, hcols) + ch[:, None]).to(gl.float32)
            b = (q_ch * gl.convert_layout(live, hcols) * ((4.0 * Q_SCALE) * ch_scale)[:, None]).to(DOT)
            x = gl.load(khigh_ptr + kpage * (G4 * NB) + c * (G4 * NBC) + rh * NBC + kh)
            s = mma_v2(_a_operand(_field(x, hmask), G4, NBC), _b_operand(b, NBC), s)
    return s


@gluon.jit
def _row_scores(ptr, first, n_valid, qrow, D: gl.constexpr, T: gl.constexpr):
    """q . key of T 16-bit key rows first .. first + T - 1 of the (rows, D) buffer at ptr, those from n_valid on read
    as zeros: (T, HEADS) fp32. qrow: the queries (times live) in the rows' type, chunks (KC, HEADS) in
    _cols_layout(KC). Each thread loads KC / 4 contiguous elements of a row (16 bytes), which are the first
    operand's columns in the order _b_operand gives the second's rows (4 register moves a product: the fragment
    pairs rows r and r + 8). Not through shared memory by ldmatrix: that took 8 KB more a program, and a program's
    shared memory decides whether it may start beside the paged programs (see _rest_gluon_kernel)."""
    mma: gl.constexpr = _mma()
    rows: gl.constexpr = _rows_layout(KC)
    t = gl.arange(0, T, layout=gl.SliceLayout(1, rows))[:, None]
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, rows))[None, :]
    base = ptr + first.to(gl.int64) * D
    s = gl.zeros([T, HEADS], gl.float32, mma)
    for c in gl.static_range(D // KC):
        x = gl.load(base + (t * D + c * KC + k), mask=t < n_valid, other=0.0)
        s = mma_v2(_a_operand(x, T, KC), _b_operand(qrow[c], KC), s)
    return s


@gluon.constexpr_function
def _rows_copy_layout(D):
    """A (T, D) tile of 16-bit rows: 8 contiguous elements (16 bytes) a thread."""
    return gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [1, 1], [1, 0])


@gluon.jit
def _copy_rows(buf, ptr, first, n_valid, D: gl.constexpr, T: gl.constexpr):
    """cp.async of 16-bit rows first .. first + T - 1 of the (rows, D) buffer at ptr into buf (T, D), one group;
    rows from n_valid on are written as zeros (a value row's p is 0 there, and 0 * NaN is not)."""
    lay: gl.constexpr = _rows_copy_layout(D)
    t = gl.arange(0, T, layout=gl.SliceLayout(1, lay))[:, None]
    c = gl.arange(0, D, layout=gl.SliceLayout(0, lay))[None, :]
    # a scalar base and the same 32-bit offsets every block (t * D + c), so that an address is one 64-bit add
    async_copy.async_copy_global_to_shared(buf, ptr + first.to(gl.int64) * D + (t * D + c),
                                           mask=(t < n_valid) & (c < D))
    async_copy.commit_group()


@gluon.jit
def _page_value_products(x, pv, acc, QUARTER: gl.constexpr, D4: gl.constexpr, G4: gl.constexpr):
    """acc + channel quarter QUARTER's fields of the (D4, G4) byte tile x (a value page's token quarter) @ pv (the
    second operand: p times the tokens' scales), times 4^-QUARTER * 2^24 (the fields' weight)."""
    lay: gl.constexpr = _rows_layout(G4)
    mask = gl.full([D4, G4], 3 << (2 * QUARTER), gl.uint8, lay)
    zero = gl.zeros([D4, HEADS], gl.float32, _mma())
    return acc + mma_v2(_a_operand(_field(x, mask), D4, G4), pv, zero) * (2.0 ** 24 / 4 ** QUARTER)


@gluon.jit
def _rest_gluon_kernel(
        q_ptr, kfp_ptr, vfp_ptr,
        klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, seqlen_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, CK, CV, KMP, VMP, NPART, FIRST_PART, NBLK,
        BPP: gl.constexpr, H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, S: gl.constexpr,
        G: gl.constexpr, NB: gl.constexpr, V_BITS: gl.constexpr, ORDER: gl.constexpr = 0, PDL: gl.constexpr = False,
        times_ptr=None):
    """Program (b, h, p), one warp: BPP blocks of sequence b's remaining tokens for KV head h, in decode_rest's
    numbering and order (ORDER: BLOCK_ORDERS' index), with a running softmax, written as part FIRST_PART + p. A
    block is T = G/4 tokens: the sink's, or one token quarter of a slot after the paged ones, its keys a key page's
    or 16-bit rows and its values a value page's or 16-bit rows. PDL and times_ptr: decode_rest._rest_kernel's (the
    merge may start at once, the grid's last program waits for the paged grid before it ends; each program's start,
    end and multiprocessor).
    Shared memory: 9 KB (the value rows' buffer). With the key rows' buffer too (17 KB), an H100 started the first of
    these programs 22 us later beside the paged launch than the Triton kernel's (BENCHMARKS.md section 1, session
    42): a hypothesis, not measured apart, is the multiprocessor's shared-memory carve-out, which the driver picks per
    kernel by what its resident programs need (12 of 17 + 1 KB: 228 KB, past the 196 KB of the paged programs' 12 of
    15.5 KB), if a program cannot start on a multiprocessor of a smaller carve-out than its kernel's before it
    empties."""
    if times_ptr is not None:
        started = _globaltimer()
    if PDL:
        _launch_dependents()
    T: gl.constexpr = G // 4
    D4: gl.constexpr = D // 4
    mma: gl.constexpr = _mma()
    cols: gl.constexpr = _cols_layout(KC)
    tcols: gl.constexpr = _cols_layout(T)           # a token quarter's (T, HEADS) second operand
    lay: gl.constexpr = _rows_layout(T)             # a value page's token quarter: (D4, T) bytes
    b = gl.program_id(0)
    h = gl.program_id(1)
    p = gl.program_id(2)
    length = gl.load(seqlen_ptr + b)
    nkp = gl.load(nkp_ptr + b)
    nvp = gl.load(nvp_ptr + b)
    n_paged = gl.minimum(nkp, nvp)
    sink_len = gl.minimum(length, S)
    n_sink = gl.cdiv(sink_len, T)
    kv_head = (b * H + h).to(gl.int64)

    # the group's queries as second operands: (KC, HEADS) chunks in the rows' type for 16-bit keys, and times
    # Q_SCALE in fp16 for a key page's codes; zero in the tile's columns past the group (decode_gluon._live_heads)
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, cols))
    live = gl.where(heads < GROUP, 1.0, 0.0)[None, :]
    q_rows = q_ptr + (kv_head * GROUP + gl.minimum(heads, GROUP - 1)[None, :]) * D
    d = gl.arange(0, KC, layout=gl.SliceLayout(1, cols))[:, None]
    qrow = ()
    q16 = ()
    for c in gl.static_range(D // KC):
        qc = gl.load(q_rows + c * KC + d).to(gl.float32) * live
        qrow = qrow + (qc.to(kfp_ptr.dtype.element_ty),)
        q16 = q16 + ((qc * Q_SCALE).to(DOT),)
    # a block's 16-bit value rows, by cp.async
    v_s = gl.allocate_shared_memory(vfp_ptr.dtype.element_ty, [T, D], gl.SwizzledSharedLayout(8, 1, 1, [1, 0]))

    tokens = gl.arange(0, T, layout=gl.SliceLayout(1, mma))
    out_heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
    # the padding heads' running max starts above any score: their probabilities are 0 (decode_gluon.PAD_HEAD_MAX)
    m_i = gl.where(out_heads < GROUP, float("-inf"), PAD_HEAD_MAX)
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, mma))
    acc0 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc1 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc2 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc3 = gl.zeros([D4, HEADS], gl.float32, mma)
    for i in range(BPP):
        j = p * BPP + i if ORDER == 0 else p + i * gl.num_programs(2)
        if (j < NBLK) & _block_exists(j, n_sink, sink_len, n_paged, length, S, G, T):
            in_sink = j < n_sink
            u = gl.maximum(j - n_sink, 0)
            slot = n_paged + u // 4
            quarter = u % 4
            # the block's first row in the 16-bit buffers (the sink's, or the slot's past each side's pages) and its
            # tokens that exist: in the sink, or in the sequence
            n_valid = gl.where(in_sink, sink_len - j * T, length - S - slot * G - quarter * T)
            valid = tokens < n_valid
            key_page = (j >= n_sink) & (slot < nkp)
            value_page = (j >= n_sink) & (slot < nvp)
            # the block's 16-bit value rows first, so that their latency is spent on its keys' arithmetic
            _BARRIER()                              # every lane has read the previous block's rows
            if not value_page:
                vrow = gl.where(in_sink, j * T, S + (slot - nvp) * G + quarter * T)
                _copy_rows(v_s, vfp_ptr + kv_head * CV * D, vrow, n_valid, D, T)
            # keys: a key page's token quarter, or 16-bit rows
            if key_page:
                kpage = gl.load(ktab_ptr + b * KMP + slot).to(gl.int64) * H + h
                s = _page_scores(kpage, quarter, q16, q_rows, live, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                                 kzero_ptr, D, G, NB)
                scores = s * (qk_scale * (1.0 / Q_SCALE) * (1 << (24 - 2 * quarter)).to(gl.float32))
            else:
                krow = gl.where(in_sink, j * T, S + (slot - nkp) * G + quarter * T)
                scores = _row_scores(kfp_ptr + kv_head * CK * D, krow, n_valid, qrow, D, T) * qk_scale
            scores = gl.where(valid[:, None], scores, float("-inf"))
            # the online softmax
            m_new = gl.maximum(m_i, gl.max(scores, axis=0))
            alpha = gl.exp2(m_i - m_new)
            prob = gl.exp2(scores - m_new[None, :])
            l_i = l_i * alpha + gl.sum(prob, axis=0)
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            acc2 = acc2 * alpha[None, :]
            acc3 = acc3 * alpha[None, :]
            m_i = m_new
            # values: a value page's token quarter, or 16-bit rows
            if value_page:
                vpage = gl.load(vtab_ptr + b * VMP + slot).to(gl.int64) * H + h
                vt = gl.arange(0, T, layout=gl.SliceLayout(1, tcols))
                pc = gl.convert_layout(prob, tcols)
                vscale = gl.load(vscale_ptr + vpage * G + quarter * T + vt)
                vzero = gl.load(vzero_ptr + vpage * G + quarter * T + vt).to(gl.float32)
                pv = _b_operand(_mul2(pc.to(DOT), vscale[:, None]), T)
                # sum_t p_t * zero_t, on every channel
                pz = gl.convert_layout(gl.sum(pc * vzero[:, None], axis=0), gl.SliceLayout(0, mma))[None, :]
                vr = gl.arange(0, D4, layout=gl.SliceLayout(1, lay))[:, None]
                vk = gl.arange(0, T, layout=gl.SliceLayout(0, lay))[None, :]
                # the plane is stored chunk by chunk (layout.py): token quarter `quarter` is D4 rows of T bytes
                codes = gl.load(vlow_ptr + vpage * (D4 * G) + quarter * (D4 * T) + vr * T + vk)
                acc0 = _page_value_products(codes, pv, acc0, 0, D4, T) + pz
                acc1 = _page_value_products(codes, pv, acc1, 1, D4, T) + pz
                acc2 = _page_value_products(codes, pv, acc2, 2, D4, T) + pz
                acc3 = _page_value_products(codes, pv, acc3, 3, D4, T) + pz
                if V_BITS == 4:
                    codes = gl.load(vhigh_ptr + vpage * (D4 * G) + quarter * (D4 * T) + vr * T + vk)
                    pv4 = pv * 4.0                                          # the high bits weigh 4 (exact)
                    acc0 = _page_value_products(codes, pv4, acc0, 0, D4, T)
                    acc1 = _page_value_products(codes, pv4, acc1, 1, D4, T)
                    acc2 = _page_value_products(codes, pv4, acc2, 2, D4, T)
                    acc3 = _page_value_products(codes, pv4, acc3, 3, D4, T)
            else:
                async_copy.wait_group(0)
                _BARRIER()                          # every lane's copies have landed
                pb = gl.convert_layout(prob.to(vfp_ptr.dtype.element_ty), gl.DotOperandLayout(1, mma, 2))
                a: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
                acc0 = mma_v2(v_s.slice(0, D4, dim=1).permute([1, 0]).load(a), pb, acc0)
                acc1 = mma_v2(v_s.slice(1 * D4, D4, dim=1).permute([1, 0]).load(a), pb, acc1)
                acc2 = mma_v2(v_s.slice(2 * D4, D4, dim=1).permute([1, 0]).load(a), pb, acc2)
                acc3 = mma_v2(v_s.slice(3 * D4, D4, dim=1).permute([1, 0]).load(a), pb, acc3)

    hmask = out_heads < GROUP
    idx = (kv_head * GROUP + out_heads).to(gl.int64) * NPART + FIRST_PART + p
    gl.store(pm_ptr + idx, m_i, mask=hmask)
    gl.store(pl_ptr + idx, l_i, mask=hmask)
    c = gl.arange(0, D4, layout=gl.SliceLayout(1, mma))
    out = po_ptr + idx[None, :] * D + c[:, None]
    omask = (c < D4)[:, None] & hmask[None, :]
    gl.store(out, acc0, mask=omask)
    gl.store(out + D4, acc1, mask=omask)
    gl.store(out + 2 * D4, acc2, mask=omask)
    gl.store(out + 3 * D4, acc3, mask=omask)
    if times_ptr is not None:
        row = times_ptr + ((b * H + h) * gl.num_programs(2) + p).to(gl.int64) * TIMES_ROW
        gl.store(row, started)
        gl.store(row + 1, _globaltimer())
        gl.store(row + 2, _smid().to(gl.int64))
    if PDL:
        if (b == gl.num_programs(0) - 1) & (h == gl.num_programs(1) - 1) & (p == gl.num_programs(2) - 1):
            _wait_grids()


@gluon.jit
def _wait_grids():
    """griddepcontrol.wait: until the grids this one was launched beside by programmatic dependent launch are done."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def kernel_arguments(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, first_part: int, pdl: bool = False,
                     blocks_per_program: int = 1, order: str = "runs") -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _rest_gluon_kernel: parts (output, max, sum) first_part ..
    first_part + rest_parts(kv, blocks_per_program) - 1 of each row, as decode_rest.rest_kernel_arguments. Also used
    to compile the kernel for a profile (kernels.sass_profile)."""
    hq, d = q.shape[1:]
    h = kv.k_fp.shape[1]
    args = (q, kv.k_fp, kv.v_fp, kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero, kv.v_low, kv.v_high,
            kv.v_scale, kv.v_zero, kv.k_table, kv.v_table, kv.seq_len, kv.n_kpages, kv.n_vpages, *parts, qk_scale,
            kv.k_fp.shape[2], kv.v_fp.shape[2], kv.k_table.shape[1], kv.v_table.shape[1], parts[1].shape[2],
            first_part, rest_parts(kv))
    constants = dict(BPP=blocks_per_program, H=h, GROUP=hq // h, D=d, S=kv.sink, G=kv.page_size, NB=kv.n_boost,
                     V_BITS=kv.v_bits, ORDER=BLOCK_ORDERS.index(order), PDL=pdl)
    return args, constants


# launch's register cap by default: a program then fits in the registers of one ended paged program (one warp at 168,
# decode_attention.GLUON_MAXNREG), where the compiler's choice, 255, took those of two; without spills (kernels.
# sass_profile --kernel rest-gluon --maxnreg 168: about 3 % more instructions). Not measured yet: bench tune --vary
# rest-kernel runs both
MAXNREG = 168


def launch(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, first_part: int, pdl: bool = False,
           blocks_per_program: int = 1, times: torch.Tensor | None = None, order: str = "runs",
           maxnreg: int | None = None) -> None:
    """Run _rest_gluon_kernel (see kernel_arguments) for every sequence and KV head, one warp a program,
    blocks_per_program blocks each, at a register cap (default MAXNREG; 255: the compiler's choice); pdl, times:
    decode_rest.launch_rest's."""
    args, constants = kernel_arguments(q, kv, qk_scale, parts, first_part, pdl, blocks_per_program, order)
    grid = (q.shape[0], kv.k_fp.shape[1], rest_parts(kv, blocks_per_program))
    maxnreg = maxnreg or MAXNREG
    _rest_gluon_kernel[grid](*args, **constants, times_ptr=times, num_warps=1,
                             **({"launch_pdl": True} if pdl else {}), **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
