"""Decode attention's paged slots on Hopper's warpgroup matrix instruction: four warps share each page.

decode_gluon.py's kernel gives a page to one warp with mma.sync (16-row products): on the H200 its warps wait about
85 % of the time, 3 a scheduler, because each holds a whole page's state in 168 registers (BENCHMARKS.md section
1, session 14). Here a program is one warpgroup, and wgmma's 64-row products split every page's rows over its 4
warps, with the same page layout, unpacking and arithmetic:

- The A operands stay in registers, built as in decode_gluon.py (a byte tile read as it lies, its columns declared
  to be in the operand's order, each 2-bit field masked into a subnormal fp16). A byte holds 4 fields (token
  quarters of a key page, channel quarters of a value page) of a 32-row tile, and a 64-row product takes two of
  them: warps 0 / 1 read rows 0-15 / 16-31 and unpack field 2j, warps 2 / 3 read the same rows and unpack field
  2j + 1 (`_fields_layout`: the tile's first dimension is the field, on the second warp bit). So product j's
  row r is token (or channel) 64j + r, and each warp unpacks a quarter of the page.
- The B operands (queries times the key page's scales, probabilities times the value page's scales, in the A
  operands' column order; and the zero terms' operands for products with ones) go through shared memory, written
  by all 128 threads once per page.
- Accumulators: 64 x 8 tiles, 4 registers a thread each; the online softmax's maximum over a page's tokens is a
  reduction across the 4 warps.

The same split of paged slots, partial outputs and merge as decode_gluon.py, whose shared-memory buffers and
cp.async copies this kernel uses with 4 warps. An experiment behind decode_attention(kernel="wgmma"), for pages
and head_dim of 128 (the fields of one byte tile make a 64-row product only with 32 rows): compiled for sm_90 and
profiled statically on the CPU (tests/test_kernels.py, `python -m kernels.sass_profile --kernel wgmma`); its
results on a GPU are tested against the reference in the same test as decode_gluon.py's kernel. Not yet measured.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .decode_gluon import CONVERT_SCRATCH as ONE_WARP_SCRATCH
from .decode_gluon import (DOT, HEADS, HEADS_PER_TILE, KC, Q_SCALE, QUARTER_WEIGHT, SHARED_PER_SM, SHARED_RESERVED,
                           _BARRIER, _chunk, _copy_keys, _copy_values, _first_slots, _mul2, _operand_columns,
                           _operand_rows, _pick, _queries, _spread, kernel_arguments)
from .decode_gluon import shared_bytes as one_warp_shared_bytes
from .layout import PagedKV

WARPS = gl.constexpr(4)       # a warpgroup
ROWS = gl.constexpr(32)       # rows of a byte tile: a quarter of a 128-token page or of 128 channels
# fields (2j, 2j + 1) of a byte, masked in place as in decode_gluon.QUARTER_ASM, the mask chosen per warp
FIELD_ASM = gl.constexpr("and.b32 $0, $2, $4; and.b32 $1, $3, $4;")


def supports(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether this kernel handles the launch: a Hopper GPU (wgmma), 16-bit queries, a KV group of at most 8
    heads, head_dim 128 and pages of 128 tokens, boosted channels that the 32-channel chunks tile (0, 16 or a
    multiple of 32), 2- or 4-bit values, and page tables with a column each."""
    bsz, hq, d = q.shape
    h = kv.k_fp.shape[1]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16) and hq // h <= HEADS_PER_TILE
            and d == 128 and kv.page_size == 128 and (kv.n_boost in (0, 16) or kv.n_boost % 32 == 0)
            and kv.v_bits in (2, 4) and kv.k_table.shape[1] > 0 and kv.v_table.shape[1] > 0)


@gluon.constexpr_function
def _acc():
    """(64, HEADS) accumulator tiles of the warpgroup: warp w holds rows 16w to 16w + 15."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8, 16])


@gluon.constexpr_function
def _fields_layout(K):
    """A (2, ROWS, K) byte tile, element (f, r, k) byte (r, k) of a tile to be unpacked as its field 2j + f: each
    thread K/4 contiguous bytes of rows lane / 4 and lane / 4 + 8 (decode_gluon._rows_layout), warp bit 0 the
    row's half, warp bit 1 the field. Reshaped to (64, K), it is the A operand's row layout."""
    regs = [[0, 0, 1 << i] for i in range((K // 4).bit_length() - 1)] + [[0, 8, 0]]
    lanes = [[0, 0, K // 4], [0, 0, K // 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [[0, 16, 0], [1, 0, 0]], [], [2, ROWS, K])


@gluon.constexpr_function
def _b_shared(K):
    return gl.NVMMASharedLayout.get_default_for([K, HEADS_PER_TILE], gl.float16)


@gluon.constexpr_function
def _operand_layout():
    """A (32, HEADS) chunk of a B operand before it is stored: 2 heads of a row a thread, the warps over the rows
    (a 16-row chunk is held twice)."""
    return gl.BlockedLayout([1, 2], [32 * 2 // HEADS_PER_TILE, HEADS_PER_TILE // 2], [WARPS, 1], [1, 0])


@gluon.jit
def _field_masks(K: gl.constexpr, J: gl.constexpr):
    """The AND masks of fields 2J + f, f = 0 (warps 0, 1) or 1 (warps 2, 3), for the words _spread makes: the
    field's 2 bits in bytes 0 and 2 of each word (a byte tile of (2, ROWS, K) elements, packed 4 a register)."""
    lay: gl.constexpr = _fields_layout(K)
    f = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, lay)))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, lay)))
    k = gl.arange(0, K, layout=gl.SliceLayout(0, gl.SliceLayout(1, lay)))
    bits = gl.where(k[None, None, :] % 2 == 0, (3 << (2 * (2 * J + f)))[:, None, None], 0)
    return (bits + 0 * r[None, :, None]).to(gl.uint8)


@gluon.jit
def _tile_pair(x_s, K: gl.constexpr):
    """A (ROWS, K) byte tile from shared memory -> the words of its fields for both halves of the warpgroup."""
    lay: gl.constexpr = _fields_layout(K)
    t, u = _spread(x_s.load(gl.SliceLayout(0, lay)))
    z = gl.full([2, ROWS, K], 0, gl.uint8, lay)
    t, _ = gl.broadcast(gl.expand_dims(t, 0), z)
    u, _ = gl.broadcast(gl.expand_dims(u, 0), z)
    return t, u


@gluon.jit
def _field_operand(t, u, mask, K: gl.constexpr):
    """Fields (2j, 2j + 1) of the words (t, u) as the (64, K) A operand: row r < 32 field 2j of byte row r, row
    r >= 32 field 2j + 1 of byte row r - 32, code * 4^field * 2^-24 in fp16, columns in operand order."""
    c = gl.inline_asm_elementwise(asm=FIELD_ASM, constraints="=r,=r,r,r,r", args=[t, u, mask], dtype=DOT,
                                  is_pure=True, pack=4)
    c = _operand_columns(gl.reshape(c, [2 * ROWS, K]), 2 * ROWS, K)
    return gl.convert_layout(c, gl.DotOperandLayout(0, _acc(), 2), assert_trivial=True)


@gluon.jit
def _tile_products(x_s, b_s, acc0, acc1, masks, K: gl.constexpr):
    """acc_j += (fields 2j, 2j + 1 of the byte tile x_s) @ b_s, j = 0, 1, issued without waiting for them."""
    t, u = _tile_pair(x_s, K)
    acc0 = warpgroup_mma(_field_operand(t, u, masks[0], K), b_s, acc0, is_async=True)
    acc1 = warpgroup_mma(_field_operand(t, u, masks[1], K), b_s, acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def _ones_products(ones_s, b_s, acc, K: gl.constexpr):
    """acc += ones @ b_s over b_s's K rows (a sum over rows, on every row of acc), 32 rows a product, the ones
    read from shared memory (in registers they are rebuilt for every in-flight product)."""
    for c in gl.static_range(K // KC):
        acc = warpgroup_mma(ones_s, b_s.slice(c * KC, KC), acc, is_async=True)
    return acc


@gluon.jit
def _row_weights(J: gl.constexpr):
    """2^24 / 4^field of product J's rows: field 2J on rows 0-31, 2J + 1 on rows 32-63."""
    r = gl.arange(0, 2 * ROWS, layout=gl.SliceLayout(1, _acc()))
    return gl.where(r < ROWS, _pick(QUARTER_WEIGHT, 2 * J), _pick(QUARTER_WEIGHT, 2 * J + 1))


@gluon.jit
def _key_scores(kbufs, kpage, q_s, q_rows, hmask_b, qk_scale, kscale_ptr, bk_s, bz_s, bnb_s, ones_s, masks,
                nb_masks, D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr):
    """A key page's scores (log2 units) as two (64 tokens, HEADS) accumulator tiles, tokens 0-63 and 64-127. q_s:
    the group's queries times Q_SCALE in shared memory, fp16 (D / KC, KC, HEADS); q_rows / hmask_b: (1, HEADS)
    pointers to the query rows and the real heads, for the boosted channels' gather. The B operands are written
    first: q * scale in the codes' column order, q * zero in any (a product with ones), 4 q * scale of the boosted
    channels."""
    G4: gl.constexpr = G // 4
    lay: gl.constexpr = _operand_layout()
    vec: gl.constexpr = gl.SliceLayout(1, lay)
    acc: gl.constexpr = _acc()
    klow_s, khigh_s, ch_s, kscale_s, kzero_s = kbufs
    for c in gl.static_range(D // KC):
        q = q_s.index(c).load(lay)
        bk_s.slice(c * KC, KC).store(_operand_rows(_mul2(q, kscale_s.slice(c * KC, KC).load(vec)[:, None]), KC))
        bz_s.slice(c * KC, KC).store(_mul2(q, kzero_s.slice(c * KC, KC).load(vec)[:, None]))
    if NB > 0:
        NBC: gl.constexpr = _chunk(NB)
        nbl: gl.constexpr = _operand_layout()
        for c in gl.static_range(NB // NBC):
            ch = ch_s.slice(c * NBC, NBC).load(gl.SliceLayout(1, nbl)).to(gl.int32)
            ch_scale = gl.load(kscale_ptr + kpage * D + ch).to(gl.float32)
            q_ch = gl.load(gl.convert_layout(q_rows, nbl) + ch[:, None], mask=gl.convert_layout(hmask_b, nbl),
                           other=0.0)
            bnb = (q_ch.to(gl.float32) * ((4.0 * Q_SCALE) * ch_scale)[:, None]).to(DOT)
            bnb_s.slice(c * NBC, NBC).store(_operand_rows(bnb, NBC))
    fence_async_shared()
    _BARRIER()
    s0 = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    s1 = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    zq = _ones_products(ones_s, bz_s, gl.zeros([2 * ROWS, HEADS], gl.float32, acc), D)
    # each chunk's 2 products run while the next chunk is unpacked: one chunk's operands in flight at a time
    for c in gl.static_range(D // KC):
        s0, s1 = _tile_products(klow_s.slice(c * G4, G4), bk_s.slice(c * KC, KC), s0, s1, masks, KC)
        s0, s1, zq = warpgroup_mma_wait(2, deps=[s0, s1, zq])
    if NB > 0:
        NBC2: gl.constexpr = _chunk(NB)
        for c in gl.static_range(NB // NBC2):
            s0, s1 = _tile_products(khigh_s.slice(c * G4, G4), bnb_s.slice(c * NBC2, NBC2), s0, s1, nb_masks, NBC2)
            s0, s1, zq = warpgroup_mma_wait(2, deps=[s0, s1, zq])
    s0, s1, zq = warpgroup_mma_wait(0, deps=[s0, s1, zq])
    scale = qk_scale * (1.0 / Q_SCALE)
    zq = zq * scale
    return s0 * (_row_weights(0) * scale)[:, None] + zq, s1 * (_row_weights(1) * scale)[:, None] + zq


@gluon.jit
def _store_probabilities(bv_s, bv4_s, bp_s, bpz_s, p, vscale_s, vzero_s, J: gl.constexpr, V_BITS: gl.constexpr):
    """Product J's probabilities (64 tokens, HEADS), tokens 64J to 64J + 63, into the value products' B operands:
    p * scale in the value codes' column order (4 p * scale for the high plane of 4-bit values), p and p * zero in
    any (products with ones)."""
    tokens: gl.constexpr = gl.SliceLayout(1, _acc())
    p = p.to(DOT)
    pv = _mul2(p, vscale_s.slice(64 * J, 2 * ROWS).load(tokens)[:, None])
    bp_s.slice(64 * J, 2 * ROWS).store(p)
    bpz_s.slice(64 * J, 2 * ROWS).store(_mul2(p, vzero_s.slice(64 * J, 2 * ROWS).load(tokens)[:, None]))
    pv = _operand_rows(pv, ROWS, 2)
    bv_s.slice(64 * J, 2 * ROWS).store(pv)
    if V_BITS == 4:
        bv4_s.slice(64 * J, 2 * ROWS).store(pv * 4.0)


@gluon.jit
def _value_products(vbufs, bv_s, bv4_s, bp_s, bpz_s, ones_s, s0, s1, m_i, l_t, z_t, acc0, acc1, masks,
                    D: gl.constexpr, G: gl.constexpr, V_BITS: gl.constexpr):
    """The online softmax over a page's scores (full pages: no token masked) and the value page in vbufs
    accumulated: out^T (channel, head) += codes (channel, token) @ (p * scale) (token, head), acc_j holding channels
    64j to 64j + 63; the sums of p and of p * zero are products with ones (l_t, z_t: every row the sum)."""
    G4: gl.constexpr = G // 4
    D4: gl.constexpr = D // 4
    acc: gl.constexpr = _acc()
    vlow_s, vhigh_s, vscale_s, vzero_s = vbufs
    m_new = gl.maximum(m_i, gl.max(gl.maximum(s0, s1), axis=0))
    alpha = gl.exp2(m_i - m_new)[None, :]
    _store_probabilities(bv_s, bv4_s, bp_s, bpz_s, gl.exp2(s0 - m_new[None, :]), vscale_s, vzero_s, 0, V_BITS)
    _store_probabilities(bv_s, bv4_s, bp_s, bpz_s, gl.exp2(s1 - m_new[None, :]), vscale_s, vzero_s, 1, V_BITS)
    fence_async_shared()
    _BARRIER()
    l_t = l_t * alpha
    z_t = z_t * alpha
    acc0 = acc0 * alpha
    acc1 = acc1 * alpha
    l_t = _ones_products(ones_s, bp_s, l_t, G)
    z_t = _ones_products(ones_s, bpz_s, z_t, G)
    for i in gl.static_range(4):
        acc0, acc1 = _tile_products(vlow_s.slice(i * D4, D4), bv_s.slice(i * G4, G4), acc0, acc1, masks, G4)
        l_t, z_t, acc0, acc1 = warpgroup_mma_wait(2, deps=[l_t, z_t, acc0, acc1])
        if V_BITS == 4:
            acc0, acc1 = _tile_products(vhigh_s.slice(i * D4, D4), bv4_s.slice(i * G4, G4), acc0, acc1, masks, G4)
            l_t, z_t, acc0, acc1 = warpgroup_mma_wait(2, deps=[l_t, z_t, acc0, acc1])
    l_t, z_t, acc0, acc1 = warpgroup_mma_wait(0, deps=[l_t, z_t, acc0, acc1])
    return m_new, l_t, z_t, acc0, acc1


@gluon.jit(do_not_specialize=["KMP", "VMP", "NSPLIT", "NPART"])
def _wgmma_paged_kernel(
        q_ptr, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, KMP, VMP, NSPLIT, NPART,
        H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr,
        V_BITS: gl.constexpr):
    """Program (b, h, part < NSPLIT), one warpgroup: the paged slots [start, end) of sequence b, KV head h (the
    Triton kernel's _program_slots split), written as partial (output, max, sum) number `part`; the page pipeline
    of decode_gluon._gluon_paged_kernel."""
    b = gl.program_id(0)
    h = gl.program_id(1)
    part = gl.program_id(2)
    start, end, last, ktab, vtab, kbufs, vbufs, kpage, kpage_next, vpage_next = _first_slots(
        b, h, part, ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr, KMP, VMP, NSPLIT, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
        kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, H, D, G, NB, V_BITS, WARPS)
    q_rows, hmask_b, q_s = _queries(q_ptr, b, h, H, GROUP, D, _operand_layout(),
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # the B operands, rewritten every page
    bk_s = gl.allocate_shared_memory(DOT, [D, HEADS], _b_shared(D))
    bz_s = gl.allocate_shared_memory(DOT, [D, HEADS], _b_shared(D))
    bnb_s = gl.allocate_shared_memory(DOT, [max(NB, 16), HEADS], _b_shared(max(NB, 16)))
    bv_s = gl.allocate_shared_memory(DOT, [G, HEADS], _b_shared(G))
    bv4_s = gl.allocate_shared_memory(DOT, [G if V_BITS == 4 else 16, HEADS], _b_shared(G))
    bp_s = gl.allocate_shared_memory(DOT, [G, HEADS], _b_shared(G))
    bpz_s = gl.allocate_shared_memory(DOT, [G, HEADS], _b_shared(G))
    # ones for the sums over rows (the keys' zero term, the sums of p and of p * zero), as an A operand
    ones_s = gl.allocate_shared_memory(DOT, [2 * ROWS, KC], gl.NVMMASharedLayout.get_default_for([2 * ROWS, KC], DOT))
    ones_s.store(gl.full([2 * ROWS, KC], 1.0, DOT, gl.BlockedLayout([1, 8], [16, 2], [WARPS, 1], [1, 0])))
    masks = (_field_masks(KC, 0), _field_masks(KC, 1))
    nb_masks = (_field_masks(_chunk(max(NB, 16)), 0), _field_masks(_chunk(max(NB, 16)), 1))

    acc: gl.constexpr = _acc()
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, acc))
    l_t = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    z_t = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    acc0 = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    acc1 = gl.zeros([2 * ROWS, HEADS], gl.float32, acc)
    for slot in range(start, end):
        more = slot + 1 < end
        kpage_after = gl.load(ktab + gl.minimum(slot + 2, last)).to(gl.int64) * H + h
        vpage_after = gl.load(vtab + gl.minimum(slot + 2, last)).to(gl.int64) * H + h
        async_copy.wait_group(1)                    # this slot's keys are in (its values may not be)
        _BARRIER()                                  # ... for every thread, and every thread's last page is done
        s0, s1 = _key_scores(kbufs, kpage, q_s, q_rows, hmask_b, qk_scale, kscale_ptr, bk_s, bz_s, bnb_s, ones_s,
                             masks, nb_masks, D, G, NB)
        _BARRIER()                                  # every warp's key reads are done: refill the key buffer
        if more:
            _copy_keys(kbufs, kpage_next, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, D, G, NB, WARPS)
        async_copy.commit_group()
        async_copy.wait_group(1)                    # this slot's values are in (the next slot's keys may not be)
        _BARRIER()
        m_i, l_t, z_t, acc0, acc1 = _value_products(vbufs, bv_s, bv4_s, bp_s, bpz_s, ones_s, s0, s1, m_i, l_t, z_t,
                                                    acc0, acc1, masks, D, G, V_BITS)
        _BARRIER()                                  # the value reads are done: refill the value buffer
        if more:
            _copy_values(vbufs, vpage_next, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, D, G, V_BITS, WARPS)
        async_copy.commit_group()
        kpage = kpage_next
        kpage_next = kpage_after
        vpage_next = vpage_after
    async_copy.wait_group(0)

    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, acc))
    hmask = heads < GROUP
    idx = ((b * H + h) * GROUP + heads).to(gl.int64) * NPART + part
    gl.store(pm_ptr + idx, m_i, mask=hmask)
    gl.store(pl_ptr + idx, gl.max(l_t, axis=0), mask=hmask)           # rows all equal: any one of them
    r = gl.arange(0, 2 * ROWS, layout=gl.SliceLayout(1, acc))
    out = po_ptr + idx[None, :] * D + r[:, None]
    omask = (r < 2 * ROWS)[:, None] & hmask[None, :]
    zrow = gl.max(z_t, axis=0)[None, :]
    gl.store(out, acc0 * _row_weights(0)[:, None] + zrow, mask=omask)
    gl.store(out + 2 * ROWS, acc1 * _row_weights(1)[:, None] + zrow, mask=omask)


CONVERT_SCRATCH = 128               # the maximum's reduction across the 4 warps
ONES_BYTES = 64 * 32 * 2            # the (64, 32) fp16 ones of the products that sum over rows


def shared_bytes(kv: PagedKV, head_dim: int) -> int:
    """Shared memory of one program: the queries and a slot's buffers (decode_gluon's, without its conversion
    scratch), the B operands written each page (fp16, 8 heads: q * scale and q * zero over the channels, the boosted
    channels', p * scale, p and p * zero over the tokens, and 4 p * scale for 4-bit values), the ones and the
    scratch (tests/test_kernels.py checks this against compiled kernels)."""
    g, nb, d = kv.page_size, kv.n_boost, head_dim
    operands = 2 * HEADS_PER_TILE * (2 * d + nb + 3 * g + (g if kv.v_bits == 4 else 0))
    return one_warp_shared_bytes(kv, head_dim) - ONE_WARP_SCRATCH + operands + ONES_BYTES + CONVERT_SCRATCH


def resident_programs(kv: PagedKV, head_dim: int, maxnreg: int) -> int:
    """Programs resident on a multiprocessor: 4 warps each, one a scheduler, bounded by registers (each scheduler's
    file of 16,384 holds whole warps, in steps of 8 registers a thread), by 16 warps a scheduler, and by shared
    memory."""
    by_registers = 16384 // (32 * (-(-maxnreg // 8) * 8))
    by_shared = SHARED_PER_SM // (shared_bytes(kv, head_dim) + SHARED_RESERVED)
    return max(1, min(by_registers, 16, by_shared))


def launch(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, num_splits: int, maxnreg: int) -> None:
    """Run _wgmma_paged_kernel with a register cap per thread (255: the compiler's); its arguments are the one-warp
    kernel's (decode_gluon.kernel_arguments)."""
    args, constants = kernel_arguments(q, kv, qk_scale, parts, num_splits)
    _wgmma_paged_kernel[(q.shape[0], kv.k_fp.shape[1], num_splits)](
        *args, **constants, num_warps=WARPS.value, **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
