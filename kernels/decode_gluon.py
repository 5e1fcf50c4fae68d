"""Decode attention's paged slots in Gluon: the page codes become tensor-core operands without leaving registers.

The Triton kernel (decode_attention.py) loads a tile of code bytes in a layout Triton picks, unpacks it and hands
it to tl.dot, which moves it through shared memory into the matrix unit's operand layout (about 2,400 SASS
instructions per page). Here the layouts are explicit (Gluon), and the page layout is read as it is:

- The contraction over a tile's columns (channels of a key page, tokens of a value page) does not care in which
  order the columns are summed, as long as both operands use the same order. Each thread reads a chunk row's bytes
  in one contiguous run and those bytes are declared to BE the columns the mma.sync fragment gives that thread:
  column k' = 16t + 8h + 2c + e of the operand is byte 4t + 2h + e of thread c's run (`_a_operand`, a reshape and a
  permute that `convert_layout(..., assert_trivial=True)` proves cost nothing). The other operand (queries times
  scales, or probabilities times scales) gets the same order the same way (`_b_operand`).
- A 32-bit word of codes becomes the fp16 operands of a quarter with one AND per pair: each 2-bit field, left
  where it is with every other bit cleared, is the subnormal number code * 4^i * 2^-24 (`QUARTER_ASM`). Quarter 3's
  products take whole bytes, the sums of the 4 fields' operands, and the other quarters' sums are taken off them.
- A page is taken 32 columns at a time (keys: a channel chunk, all 4 token quarters; values: one token quarter,
  all 4 channel quarters), so that one chunk's codes are live at once.
- Pages arrive by cp.async (by TMA on Hopper: kernel="gluon-tma") into one shared-memory buffer per kind, each
  refilled with the next slot's page as soon as this slot has read it: a page's load latency is spent on half a
  page of arithmetic. The pool stores each plane chunk by chunk, as the buffers hold it (layout.py), so a plane
  arrives as one contiguous run: one TMA box of 128-byte rows.
- The operands' scaling is fp16 arithmetic, two elements an instruction (queries times scales, probabilities times
  scales), and the sums that need no per-element weights are matrix products: the keys' zero term sum_d q_d *
  zero_d with a first operand of ones, the probabilities' sum and their sum times the values' zeros in one product
  whose first operand's rows are the zeros and ones (_zero_rows).
- A KV group of fewer than 8 heads leaves the matrix unit's other columns to padding heads, whose operands are zero
  (_live_heads): on the H200, which runs this kernel at its power limit, zeros cost the matrix unit less power.
- Scores leave the key product as (token, head) accumulator tiles; the probabilities go to the value product's
  (token, head) operand through one layout conversion per token quarter.

One warp per program, as in the Triton kernel, with the same split of paged slots over NSPLIT programs per
(sequence, KV head) and the same partial outputs; decode_rest.py runs the remaining blocks (sink, buffers) in a
launch of their own, and the same merge combines both. Measured on the H200 and not kept (BENCHMARKS.md section 1,
sessions 12, 13, 16 and 24 to 27): two warps a program, each half of a page's rows (slower or no faster at five of
six shapes), the remaining blocks as programs of this launch (plain arithmetic, slower at all six), a warpgroup a
page with Hopper's wgmma (twice the instructions a page; 2.2x slower at batch 64 / 32K), the next slot's keys
computed beside this slot's values (its arithmetic alone no faster, 359.5 against 358.7 us at batch 64 / 32K),
programs taking their slots from a counter as they go (balanced, and no faster: session 24), the slot after next's
pages prefetched into L2 (slower at every shape), the boosted channels' queries gathered from a transposed copy
(2 % faster at batch 64 / 32K, up to 13 % slower elsewhere: session 25; since session 39 the "q-rows" experiment,
Q_ROWS, which "auto" takes for kitty-pro's longest launches only), two token quarters' scores in one tile
where the KV group has at most 4 heads (64 fewer softmax instructions a page: no faster at batch 64 / 32K, 5 %
faster at 1 / 32K), the sums of p and of p * zero as fp32 multiply-adds instead of products with ones (16 fewer
matrix products a page: within 1 % at batch 64, 3-4 % slower at 1 / 4K; both session 26, in git history) and the
integer products with these fp16 operands split into two 8-bit limbs (x * s = hi + lo / 128; one AND per 4 codes,
each product twice: 14 % slower at batch 64 / 32K for the keys and values, 7 % for the keys alone, and the value
limbs 2-3x less exact) and a second value buffer at 12 programs a multiprocessor (within 1 % at batch 64 / 32K, up
to 7 % slower at batch 1; both session 27, in git history), and the remaining blocks taken by each sequence's last
paged program, before or after its page loop, instead of decode_rest.py's launch (a chain of dependent loads: slower
at every shape, 384.4 against 377.0 us for kitty-pro at batch 64 / 32K; session 39, commits 23d8cba-8e7b13b). A
second key buffer was not built: the programs wait for their key pages 1.5 % of their cycles and for their value
pages 1.6 % (kitty-pro at batch 64 / 32K, `bench tune --vary timeline`'s WAITS; session 29). No CPU interpreter runs
Gluon: `decode_attention(..., kernel="gluon")` is tested on a GPU against the PyTorch reference
(tests/test_kernels.py), and its static profile comes from `python -m kernels.sass_profile --kernel gluon`.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .decode_rest import TIMES_ROW
from .layout import KEY_CHUNK, PagedKV

HEADS_PER_TILE = 8          # the matrix instruction's columns: a KV group of up to 8 query heads
# A word of 4 code bytes -> itself and bytes 1 and 3 with zeros above them (a byte permute): 16-bit halves led by
# bytes 0 / 2 and 1 / 3, whose low bytes QUARTER_ASM takes fields from (so its operands pair bytes (0, 2) and (1, 3):
# consecutive columns, as the page layout stores them, layout.SWAP). The second word, clean, is also as it is quarter
# 3's operand (QUARTER_ASM)
SPREAD = gl.constexpr("mov.b32 $0, $2; prmt.b32 $1, $2, 0, 0x4341;")

# 2-bit fields -> fp16 operands: field i of a byte (bits 2i) left in place, every other bit cleared, is the fp16 bit
# pattern of the subnormal number code * 4^i * 2^-24. fp16's 10 mantissa bits hold all 4 fields of a byte, against 11
# instructions and offset products with bf16 magic numbers (the Triton kernel's unpacking; measured 10 % slower at
# batch 64 / 32K, BENCHMARKS.md section 1, session 11). The matrix unit multiplies subnormal fp16 operands exactly, and
# a quarter's weight 2^24 / 4^i is applied to its fp32 sums. Both query dtypes take fp16 operands: queries times
# scales keep 3 more bits than in bf16 (the overflow bound is Q_SCALE's, below).
# Quarter 3's products take whole bytes instead of field 3: a byte in place (zeros above it) is the subnormal number
# (sum_i code_i * 4^i) * 2^-24, the sum of the 4 quarters' operands, so its products sum all 4 quarters' products and
# quarter 3's are that less the other three's (in fp32, once a page for the keys' scores, once at the end for the
# values' running sums: _quarter3_sums). Its operands are the second word as it is and the first word less the second
# times 256 (bytes 0 and 2), an IMAD on the multiply-add pipe: a word of 16 codes takes 7 integer-pipe instructions
# (6 AND, a PRMT) and an IMAD. Measured on the H200 against field 3 by a shift and an AND (9 integer-pipe
# instructions) and against the whole bytes by an AND (8): kitty-pro's paged launch at batch 64 / 32K 402.5 against
# 409.7 and 410.2 us, its arithmetic alone 329.1 against 349.9 and 334.2 (BENCHMARKS.md section 1, session 32). (A
# shift as IMAD.HI instead of SHF.R was slower or no faster: session 14.)
QUARTER_ASM = gl.constexpr(tuple(f"and.b32 $0, $2, {m:#x}; and.b32 $1, $3, {m:#x};"
                                 for m in (0x00030003 << 2 * i for i in range(3)))
                           + ("mad.lo.u32 $0, $3, 0xffffff00, $2; mov.b32 $1, $3;",))
QUARTER_WEIGHT = gl.constexpr(tuple(2.0 ** 24 / 4 ** i for i in range(4)))
DOT = gl.float16
# The queries enter the key operands as q * Q_SCALE in fp16: exact for bf16 and fp16 queries (a power of two, where a
# query times qk_scale would be rounded), with products q * scale and q * zero up to 16 * 65,504 before they overflow;
# qk_scale / Q_SCALE is applied to the fp32 sums.
Q_SCALE = gl.constexpr(1.0 / 16)


def supports(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether the Gluon kernel handles this launch: a CUDA device of compute capability 8.0 or later (mma.sync)
    and the shapes that takes_shapes("gluon", ...) names."""
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8 and takes_shapes("gluon", q, kv)


def takes_shapes(kernel: str, q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether decode_attention's Gluon `kernel` takes this launch's shapes, whatever the device: 16-bit queries, a
    KV group of at most 8 heads, head_dim and pages of 64 or 128, boosted channels that the 32-channel chunks tile
    (0, 16 or a multiple of 32), and slots that can be paged: 2- or 4-bit values, and page tables with a column each
    (a cache's tables have none until its first page). With TMA copies, boxes of at least 16 bytes; the 8-bit key
    products take boosted channels in one chunk of 32 or none, the 8-bit value products pages of 128 and 2-bit
    values. (supports_kernel adds the device's checks; a CPU test compiles what this takes for sm_90.)"""
    bsz, hq, d = q.shape
    h, g, nb = kv.k_fp.shape[1], kv.page_size, kv.n_boost
    options = kernel_options(kernel)
    i8 = options["i8"]
    return (q.dtype in (torch.bfloat16, torch.float16) and hq // h <= HEADS_PER_TILE and d in (64, 128)
            and g in (64, 128) and (nb in (0, 16) or nb % 32 == 0) and kv.v_bits in (2, 4)
            and kv.k_table.shape[1] > 0 and kv.v_table.shape[1] > 0
            and (not options["use_tma"] or (g // 4 >= 16 and nb in (0, 16, 32, 64, 128)))
            and (i8 < 1 or nb in (0, 32)) and (i8 < 2 or (g == 128 and kv.v_bits == 2)))


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
def _operand_columns(x, R: gl.constexpr, K: gl.constexpr):
    """(R, K) tile whose threads hold K/4 contiguous columns of a row (thread c of 4 along the row) -> the same
    tile with its columns in operand order: column 16t + 8h + 2c + e is column 4t + 2h + e of thread c's run."""
    x = gl.permute(gl.reshape(x, [R, 4, K // 16, 2, 2]), [0, 2, 3, 1, 4])
    return gl.reshape(x, [R, K])


@gluon.jit
def _a_operand(x, R: gl.constexpr, K: gl.constexpr):
    """(R, K) tile in _rows_layout(K) -> the same registers as the first mma operand, columns in operand order."""
    return gl.convert_layout(_operand_columns(x, R, K), gl.DotOperandLayout(0, _mma(), 2), assert_trivial=True)


@gluon.jit
def _b_operand(x, K: gl.constexpr):
    """(K, heads) tile in _cols_layout(K) -> the same registers as the second mma operand, rows in the order that
    _operand_columns gives the first operand's columns after _tile_products' unpacking. That unpacking pairs the
    bytes of a word as (0, 2) and (1, 3), which the page layout stores as consecutive columns (layout.SWAP): no byte
    permutes here (the rows swapped in registers took 32 a kitty-pro page). A product with a first operand of ones
    (a sum over rows) takes it too: there the order does not matter."""
    x = gl.permute(gl.reshape(x, [4, K // 16, 2, 2, HEADS]), [1, 2, 0, 3, 4])
    return gl.convert_layout(gl.reshape(x, [K, HEADS]), gl.DotOperandLayout(1, _mma(), 2), assert_trivial=True)


HEADS = gl.constexpr(HEADS_PER_TILE)


@gluon.jit
def _mul2(x, y):
    """x * y in fp16, a register's two elements an instruction as they lie (the compiler pairs elements the way
    their use does, and a reordered use costs two byte permutes an instruction)."""
    x, y = gl.broadcast(x, y)
    return gl.inline_asm_elementwise(asm="mul.rn.f16x2 $0, $1, $2;", constraints="=r,r,r", args=[x, y], dtype=DOT,
                                     is_pure=True, pack=2)


@gluon.jit
def _spread(x):
    """An (R, K) byte tile -> the two words per 4 bytes that _quarter takes fields from (SPREAD: bytes 0 and 2, and 1
    and 3, of each 4, which the page layout stores as consecutive columns)."""
    return gl.inline_asm_elementwise(asm=SPREAD, constraints="=r,=r,r", args=[x], dtype=(gl.uint8, gl.uint8),
                                     is_pure=True, pack=4)


@gluon.jit
def _quarter(t, u, I: gl.constexpr, R: gl.constexpr, K: gl.constexpr):
    """Quarter I of the tile _spread gave (t, u), as a first mma operand: the 2-bit fields at bits 2I, code * 4^I *
    2^-24 in fp16, or for quarter 3 the whole bytes (QUARTER_ASM). One quarter at a time, so that a tile's four
    unpacked quarters are never live together."""
    c = gl.inline_asm_elementwise(asm=_pick(QUARTER_ASM, I), constraints="=r,=r,r,r", args=[t, u], dtype=DOT,
                                  is_pure=True, pack=4)
    return _a_operand(c, R, K)


@gluon.constexpr_function
def _pick(options, i):
    return options[i]


@gluon.jit
def _tile_products(x, b, acc0, acc1, acc2, acc3, R: gl.constexpr, K: gl.constexpr):
    """acc_i += (quarter i of the (R, K) byte tile x) @ b, for quarters 0-2: 4^i * 2^-24 * (codes @ b); acc3 += the
    whole bytes @ b, the sum of the 4 quarters' (QUARTER_ASM; _quarter3_sums takes the other 3 off)."""
    t, u = _spread(x)
    acc0 = mma_v2(_quarter(t, u, 0, R, K), b, acc0)
    acc1 = mma_v2(_quarter(t, u, 1, R, K), b, acc1)
    acc2 = mma_v2(_quarter(t, u, 2, R, K), b, acc2)
    acc3 = mma_v2(_quarter(t, u, 3, R, K), b, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _quarter3_sums(acc0, acc1, acc2, acc3):
    """Quarter 3's sums from acc3, the sums of the whole bytes' products: less the other 3 quarters' (exact but for
    fp32 rounding, at most a few units of the last place of the larger sums)."""
    return acc3 - acc0 - acc1 - acc2


@gluon.constexpr_function
def _vector_layout(N, BYTES):
    """A (N,) vector of BYTES-byte elements over a warp for cp.async: at least 4 bytes per thread."""
    return gl.BlockedLayout([max(N // 32, 4 // BYTES)], [32], [1], [0])


@gluon.jit
def _copy_vector(smem, ptr, N: gl.constexpr, BYTES: gl.constexpr):
    async_copy.async_copy_global_to_shared(smem, ptr + gl.arange(0, N, layout=_vector_layout(N, BYTES)))


# ---------------------------------------------------------------------------------------------- one paged slot
# A slot is computed a chunk of a plane's columns at a time (KC = 32 of a key page's channels, or one token quarter
# of a value page: 32 or 16 tokens), so that only one chunk's codes are unpacked and live at once: with whole tiles
# the kernel wanted 218-240 registers and spilled at its cap. A slot's tiles are read from its shared-memory
# buffers, where each plane is stored chunk by chunk ([chunks, rows, columns] bytes: conflict-free reads of a chunk).
KC = gl.constexpr(KEY_CHUNK)


@gluon.constexpr_function
def _chunk(K):
    """Columns per chunk of a key plane K columns wide (channels: 32 at a time, or all of a 16-channel plane), as
    layout.key_chunk stores it for the planes this kernel supports (0 or 16 boosted channels, or a multiple of 32)."""
    return min(K, KC)


@gluon.jit
def _key_scores(kbufs, kpage, q_s, q_rows, qk_scale, kscale_ptr, D: gl.constexpr, G: gl.constexpr,
                NB: gl.constexpr, live=None, zq_row=None, FOLD: gl.constexpr = False, QT: gl.constexpr = False):
    """Scores (log2 units) of the 4 token quarters of key page `kpage` from its buffers, (G/4 tokens, HEADS)
    accumulator tiles. q_s: the group's queries times Q_SCALE in shared memory, fp16 (D/KC, KC, HEADS), taken times
    qk_scale / Q_SCALE in the fp32 sums; q_rows: (1, HEADS) pointers to the query rows, for the boosted channels'
    gather (_queries); live: None, or _live_heads, which the gathered queries are multiplied by; zq_row: None, or
    the page's zero term per head in log2 units (ZQ_AHEAD: _zero_terms), which then takes the place of the
    products with ones and of the page's zeros. FOLD (FOLD_MAX, with zq_row): the 4 quarters' sums as they are,
    without their weights and zero term (_value_products applies them). QT (Q_ROWS): q_rows is the program's
    transposed queries (_query_rows), which the boosted channels' operand reads instead (_boosted_rows)."""
    G4: gl.constexpr = G // 4
    mma: gl.constexpr = _mma()
    cols: gl.constexpr = _cols_layout(KC)
    vec: gl.constexpr = gl.SliceLayout(1, cols)
    klow_s, khigh_s, ch_s, kscale_s, kzero_s = kbufs
    if NB > 0 and NB <= 32:
        # one chunk of boosted channels: its gathers first, so that their latency is spent on the low plane
        b_nb = _boosted_operand(ch_s, 0, kpage, q_rows, kscale_ptr, D, NB, live, QT)
    s0 = gl.zeros([G4, HEADS], gl.float32, mma)
    s1 = gl.zeros([G4, HEADS], gl.float32, mma)
    s2 = gl.zeros([G4, HEADS], gl.float32, mma)
    s3 = gl.zeros([G4, HEADS], gl.float32, mma)
    # sum_d q_d * zero_d on every row, by the matrix unit: ones @ (q * zero), a product per 16 x 16 tile instead of a
    # conversion and a multiply-add per element and a reduction over lanes
    zq = gl.zeros([G4, HEADS], gl.float32, mma)
    ones = gl.full([G4, KC], 1.0, DOT, gl.DotOperandLayout(0, mma, 2))
    for c in gl.static_range(D // KC):
        q = q_s.index(c).load(cols)                     # the operands in fp16 arithmetic: 2 elements an instruction
        if zq_row is None:
            zq = mma_v2(ones, _b_operand(_mul2(q, kzero_s.slice(c * KC, KC).load(vec)[:, None]), KC), zq)
        b = _b_operand(_mul2(q, kscale_s.slice(c * KC, KC).load(vec)[:, None]), KC)
        s0, s1, s2, s3 = _tile_products(klow_s.slice(c * G4, G4).load(_rows_layout(KC)), b, s0, s1, s2, s3, G4, KC)
    if NB > 0:
        # boosted channels: + 4 * (q_c * scale_c) * high_c over the NB channels of the high plane
        NBC: gl.constexpr = _chunk(NB)
        for c in gl.static_range(NB // NBC):
            if NB > 32:
                b_nb = _boosted_operand(ch_s, c, kpage, q_rows, kscale_ptr, D, NBC, live, QT)
            s0, s1, s2, s3 = _tile_products(khigh_s.slice(c * G4, G4).load(_rows_layout(NBC)), b_nb, s0, s1, s2, s3,
                                            G4, NBC)
    s3 = _quarter3_sums(s0, s1, s2, s3)
    if FOLD:
        return s0, s1, s2, s3
    else:
        scale = qk_scale * (1.0 / Q_SCALE)
        if zq_row is None:
            zq = zq * scale
        else:
            zq = zq_row[None, :]
        return (s0 * (_pick(QUARTER_WEIGHT, 0) * scale) + zq, s1 * (_pick(QUARTER_WEIGHT, 1) * scale) + zq,
                s2 * (_pick(QUARTER_WEIGHT, 2) * scale) + zq, s3 * (_pick(QUARTER_WEIGHT, 3) * scale) + zq)


# ------------------------------------------------------------------------------ the keys' zero terms ahead (ZQ_AHEAD)
# decode_attention(kernel="gluon-tma+zq-ahead", an experiment): the keys' zero term of a page, sum_d q_d * zero_d per
# head, is a product of the page's D zeros with the queries. Page by page (_key_scores' products with ones) it takes
# D / 16 matrix products whose 16 rows are all the same sum, and 16 HMUL2 for q * zero a kitty-pro page. Here the
# zero vectors of 16 pages are the first operand's 16 rows, so that D / 16 products give 16 pages' terms: a program
# computes its next ZQ_SLOTS slots' terms at once, into shared memory, and its page loop reads a row a page. The
# products are exact (q * Q_SCALE and the zeros are fp16 operands; the product q * zero was rounded to fp16), and
# the pages' zero vectors are no longer copied into the key buffers (gathered from global memory instead: 256
# bytes a page at head_dim 128, in 16-byte loads).
ZQ_SLOTS = gl.constexpr(64)         # slots a window: 2 KB of fp32 terms for 8 heads
ZQ_PAGES = gl.constexpr(16)         # pages a product: the matrix instruction's rows


@gluon.jit
def _zero_terms(zq_s, q_s, ktab, first, end, kzero_ptr, h, scale, H: gl.constexpr, D: gl.constexpr):
    """ZQ_AHEAD: the keys' zero terms of slots first .. first + ZQ_SLOTS - 1 (those before end; ktab: the
    sequence's key page table), sum_d q_d * zero_d * scale per head (scale: qk_scale / Q_SCALE, so log2 units as
    _key_scores' sums), into zq_s (ZQ_SLOTS, HEADS) fp32, ZQ_PAGES pages a product chain: their zero vectors,
    gathered from kzero_ptr (pages x D, fp16), as the first operand's rows (columns in operand order: _a_operand),
    the queries times Q_SCALE in q_s as the second (_b_operand: the same order). Rows past `end` are zero."""
    mma: gl.constexpr = _mma()
    rows: gl.constexpr = _rows_layout(KC)
    cols: gl.constexpr = _cols_layout(KC)
    r = gl.arange(0, ZQ_PAGES, layout=gl.SliceLayout(1, rows))
    d = gl.arange(0, KC, layout=gl.SliceLayout(0, rows))
    for g in gl.static_range(ZQ_SLOTS // ZQ_PAGES):
        if first + g * ZQ_PAGES < end:
            slot = first + g * ZQ_PAGES + r
            present = slot < end
            page = gl.load(ktab + slot, mask=present, other=0).to(gl.int64) * H + h
            zq = gl.zeros([ZQ_PAGES, HEADS], gl.float32, mma)
            for c in gl.static_range(D // KC):
                zero = gl.load(kzero_ptr + page[:, None] * D + (c * KC + d)[None, :], mask=present[:, None],
                               other=0.0)
                zq = mma_v2(_a_operand(zero, ZQ_PAGES, KC), _b_operand(q_s.index(c).load(cols), KC), zq)
            zq_s.index(g).store(zq * scale)


@gluon.jit
def _zero_term_buffer(ZQ_AHEAD: gl.constexpr):
    """ZQ_AHEAD's window of terms in shared memory, (ZQ_SLOTS / ZQ_PAGES, ZQ_PAGES, HEADS) fp32, row-major (a
    placeholder of one product's terms without, which nothing uses)."""
    return gl.allocate_shared_memory(gl.float32, [ZQ_SLOTS // ZQ_PAGES if ZQ_AHEAD else 1, ZQ_PAGES, HEADS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _zero_term(zq_s, i):
    """Row i of the window in zq_s (_zero_term_buffer): slot first + i's terms, (HEADS,) in the layout of the
    scores' columns."""
    terms = zq_s._reinterpret(gl.float32, [ZQ_SLOTS, HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return terms.index(i).load(gl.SliceLayout(0, _mma()))


# ------------------------------------------------------------------------------------ 8-bit key products (I8)
# decode_attention(kernel="gluon-tma-i8"): the key products on the integer matrix unit (mma m16n8k32, s8 x s8 ->
# s32). A byte's field i, masked in place, is the integer code * 4^i (field 3, which would reach 192, is shifted down
# first): a word of 16 codes makes the 4 quarters' operands in 5 instructions (I8_QUARTER_ASM) instead of 7 and an
# IMAD, and a product covers 32 channels instead of 16. The other operand, queries times scales, is rounded to 8
# bits a page, with one scale per head (its largest magnitude over the page's channels, boosted ones included, maps
# to 127): this rounding is the variant's only change to the numbers (the fp16 operands keep 11 bits).
# Field 3 in place would be code * 64, up to 192, past s8. With its low bit flipped it is the s8 number 64 - 64 *
# code (bits 7, 6 weigh -128 and 64): one LOP3 all the same, and a product with a first operand of -64 in every byte
# (I8_MINUS64) takes the 64 * sum of the other operand back off: quarter 3 sums -64 * (codes @ b).
I8_QUARTER_ASM = gl.constexpr(("and.b32 $0, $1, 0x03030303;", "and.b32 $0, $1, 0x0c0c0c0c;",
                               "and.b32 $0, $1, 0x30303030;",
                               "lop3.b32 $0, $1, 0x40404040, 0xc0c0c0c0, 0x28;"))      # (a ^ b) & c
I8_QUARTER_WEIGHT = gl.constexpr((1.0, 1.0 / 4, 1.0 / 16, -1.0 / 64))
I8_MINUS64 = gl.constexpr(-64)
# The floor of a head's largest operand magnitude, which its operands are rounded against: 127 / 2^-9 = 65,024 is
# finite in fp16 (a floor of 2^-10 made that scale inf, and a head of zero queries NaN). kernels/i8_reference.py
# uses the same
I8_AMAX_FLOOR = gl.constexpr(2.0 ** -9)
# The s32 sums start at the bit pattern of the float 1.5 * 2^23, where consecutive floats are consecutive integers:
# a sum x (|x| < 2^22; a page's is below 2^20) leaves the float 1.5 * 2^23 + x, read with no conversion.
I8_MAGIC = gl.constexpr(0x4B400000)
I8_MAGIC_F = gl.constexpr(12582912.0)
# fp16 times the heads' 127 / max, plus 1.5 * 2^10, rounds to an integer in the low byte (ulp 1 in [1024, 2048)):
# two fp16 FMAs and a byte permute make a register of 4 signed bytes, elements 0, 2, 1, 3 of its 4: the order in
# which the page layout stores a word's columns (layout.SWAP), which the integer products take as they are.
I8_ROUND_ASM = gl.constexpr("{ .reg .b32 m, a, b; mov.b32 m, 0x66006600; fma.rn.f16x2 a, $1, $3, m; "
                            "fma.rn.f16x2 b, $2, $4, m; prmt.b32 $0, a, b, 0x6240; }")


@gluon.jit
def _i8_operand_order(x, K: gl.constexpr, LAST: gl.constexpr):
    """A tile whose threads hold K/4 contiguous elements of dimension LAST (0 or 1, of 2) as the m16n8k32 operand's
    k order: element k' = 32t + 16h + 4c + e is element 8t + 4h + e of thread c's run."""
    if LAST == 1:
        R: gl.constexpr = x.shape[0]
        x = gl.permute(gl.reshape(x, [R, 4, K // 32, 2, 4]), [0, 2, 3, 1, 4])
        return gl.reshape(x, [R, K])
    else:
        x = gl.permute(gl.reshape(x, [4, K // 32, 2, 4, HEADS]), [1, 2, 0, 3, 4])
        return gl.reshape(x, [K, HEADS])


@gluon.jit
def _i8_tile_products(x, b, acc0, acc1, acc2, acc3, K: gl.constexpr):
    """acc_i += (quarter i of the (rows, K) byte tile x, as integers) @ b (s8), for the 4 quarters."""
    a_layout: gl.constexpr = gl.DotOperandLayout(0, _mma(), 4)
    xa = _i8_operand_order(x, K, 1)
    acc0 = mma_v2(gl.convert_layout(_i8_quarter(xa, 0), a_layout, assert_trivial=True), b, acc0)
    acc1 = mma_v2(gl.convert_layout(_i8_quarter(xa, 1), a_layout, assert_trivial=True), b, acc1)
    acc2 = mma_v2(gl.convert_layout(_i8_quarter(xa, 2), a_layout, assert_trivial=True), b, acc2)
    acc3 = mma_v2(gl.convert_layout(_i8_quarter(xa, 3), a_layout, assert_trivial=True), b, acc3)
    acc3 = mma_v2(gl.full(x.shape, I8_MINUS64, gl.int8, a_layout), b, acc3)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _i8_quarter(x, I: gl.constexpr):
    return gl.inline_asm_elementwise(asm=_pick(I8_QUARTER_ASM, I), constraints="=r,r", args=[x], dtype=gl.int8,
                                     is_pure=True, pack=4)


@gluon.jit
def _i8_round(x, r, K: gl.constexpr):
    """The (K, HEADS) fp16 tile x times the heads' r (fp16, (1, HEADS)), rounded to s8 as a second m16n8k32 operand."""
    x, r = gl.broadcast(x, r)
    q = gl.inline_asm_elementwise(asm=I8_ROUND_ASM, constraints="=r,r,r,r,r", args=[x, r], dtype=gl.int8,
                                  is_pure=True, pack=4)
    return gl.convert_layout(_i8_operand_order(q, K, 0), gl.DotOperandLayout(1, _mma(), 4), assert_trivial=True)


@gluon.jit
def _key_scores_i8(kbufs, kpage, q_s, q_rows, qk_scale, kscale_ptr, D: gl.constexpr, G: gl.constexpr,
                   NB: gl.constexpr, zq_row=None):
    """_key_scores with the key products in 8-bit integers (see I8_QUARTER_ASM). Boosted channels: one chunk of
    32. zq_row: as _key_scores'."""
    G4: gl.constexpr = G // 4
    mma: gl.constexpr = _mma()
    cols: gl.constexpr = _cols_layout(KC)
    vec: gl.constexpr = gl.SliceLayout(1, cols)
    klow_s, khigh_s, ch_s, kscale_s, kzero_s = kbufs
    # sum_d q_d * zero_d per head: its rows are equal, so 16 of them suffice, and one is read (a vector per head
    # folds the sums' start into the offset of the scores' multiply-add: _i8_scores)
    zq = gl.zeros([16, HEADS], gl.float32, mma)
    ones = gl.full([16, KC], 1.0, DOT, gl.DotOperandLayout(0, mma, 2))
    # the fp16 operands and their largest magnitude per head
    amax = gl.full([HEADS], I8_AMAX_FLOOR, DOT, gl.SliceLayout(0, cols))
    bs = ()
    for c in gl.static_range(D // KC):
        q = q_s.index(c).load(cols)
        if zq_row is None:
            zq = mma_v2(ones, _b_operand(_mul2(q, kzero_s.slice(c * KC, KC).load(vec)[:, None]), KC), zq)
        b = _mul2(q, kscale_s.slice(c * KC, KC).load(vec)[:, None])
        amax = gl.maximum(amax, gl.max(gl.abs(b), axis=0))
        bs = bs + (b,)
    if NB > 0:
        b_nb = _boosted_fp16(ch_s, kpage, q_rows, kscale_ptr, D, NB)
        amax = gl.maximum(amax, gl.max(gl.abs(b_nb), axis=0))
    # IEEE division (not the approximate one of `/`), so that kernels/i8_reference.py can round the same integers
    r = gl.div_rn(gl.full([HEADS], 127.0, gl.float32, amax.type.layout), amax.to(gl.float32)).to(DOT)
    i8: gl.constexpr = gl.SliceLayout(0, mma)
    s0 = gl.full([G4, HEADS], I8_MAGIC, gl.int32, mma)
    s1 = gl.full([G4, HEADS], I8_MAGIC, gl.int32, mma)
    s2 = gl.full([G4, HEADS], I8_MAGIC, gl.int32, mma)
    s3 = gl.full([G4, HEADS], I8_MAGIC, gl.int32, mma)
    for c in gl.static_range(D // KC):
        s0, s1, s2, s3 = _i8_tile_products(klow_s.slice(c * G4, G4).load(_rows_layout(KC)),
                                           _i8_round(bs[c], r[None, :], KC), s0, s1, s2, s3, KC)
    if NB > 0:
        s0, s1, s2, s3 = _i8_tile_products(khigh_s.load(_rows_layout(NB)), _i8_round(b_nb, r[None, :], NB), s0, s1,
                                           s2, s3, NB)
    scale = gl.convert_layout(qk_scale * (1.0 / Q_SCALE) / r.to(gl.float32), i8)
    if zq_row is None:
        zq = gl.max(zq, axis=0) * (qk_scale * (1.0 / Q_SCALE))
    else:
        zq = zq_row
    return (_i8_scores(s0, scale * _pick(I8_QUARTER_WEIGHT, 0), zq),
            _i8_scores(s1, scale * _pick(I8_QUARTER_WEIGHT, 1), zq),
            _i8_scores(s2, scale * _pick(I8_QUARTER_WEIGHT, 2), zq),
            _i8_scores(s3, scale * _pick(I8_QUARTER_WEIGHT, 3), zq))


@gluon.jit
def _i8_scores(s, w, zq):
    """The s32 sums started at I8_MAGIC, read as floats, less I8_MAGIC_F (exact), times the heads' w, plus their zq.
    (Folding I8_MAGIC_F * w into zq saved the subtraction but rounded that offset by up to 0.75 of an integer unit,
    one error for 32 tokens: on the H200 it put fp16 outputs a fifth of the 8-bit rounding's effect away from
    kernels/i8_reference.py.)"""
    return (s.to(gl.float32, bitcast=True) - I8_MAGIC_F) * w[None, :] + zq[None, :]


@gluon.jit
def _i8_value_scale(vscale_s, page_max, m_new, G: gl.constexpr):
    """Per head, what p * scale is multiplied by before it is rounded to s8: 127 over its largest possible value on
    this page, the page's largest p (2^(page max - running max)) times its largest value scale; at most 65,504 (fp16),
    so a page whose p * scale stays under 2^-9 keeps fewer than 7 bits. fp16, (HEADS,) in the operand's layout."""
    vs_max = gl.max(vscale_s.load(_vector_layout(G, 2)).to(gl.float32), axis=0)
    r = gl.minimum(127.0 / (vs_max * gl.exp2(page_max - m_new)), 65504.0)
    return gl.convert_layout(r, gl.SliceLayout(0, _cols_layout(G // 4))).to(DOT)


@gluon.jit
def _i8_accumulate(acc, alpha, s, k):
    """acc * alpha + (the s32 sums s started at I8_MAGIC) * k (per head): two multiply-adds."""
    return gl.fma(s.to(gl.float32, bitcast=True), k[None, :], gl.fma(acc, alpha, -I8_MAGIC_F * k[None, :]))


@gluon.jit
def _boosted_fp16(ch_s, kpage, q_rows, kscale_ptr, D: gl.constexpr, NB: gl.constexpr, live=None):
    """The second operand of the NB boosted channels listed in ch_s before its layout: 4 * Q_SCALE * q_ch * scale_ch
    (NB, HEADS), fp16 in _cols_layout(NB), gathered from the query rows and the page's scales in global memory
    (L1 / L2); with live (_key_scores), times it."""
    lay: gl.constexpr = _cols_layout(NB)
    ch = ch_s.load(gl.SliceLayout(1, lay)).to(gl.int32)
    ch_scale = gl.load(kscale_ptr + kpage * D + ch).to(gl.float32)
    q_ch = gl.load(gl.convert_layout(q_rows, lay) + ch[:, None]).to(gl.float32)
    if live is not None:
        q_ch = q_ch * gl.convert_layout(live, lay)
    return (q_ch * ((4.0 * Q_SCALE) * ch_scale)[:, None]).to(DOT)


@gluon.jit
def _boosted_rows(ch_s, kpage, qt, kscale_ptr, D: gl.constexpr, NB: gl.constexpr):
    """Q_ROWS: _boosted_fp16 from the program's transposed queries qt (_query_rows: D rows of HEADS fp16, the queries
    times 4 * Q_SCALE, zero in the padding columns): a boosted channel a lane, its row in one 16-byte load and its
    scale in one, times each other in fp16, then the layout _boosted_fp16 gives. Against _boosted_fp16's loads of
    NB * HEADS / 32 queries and as many scales a lane, with their 64-bit addresses and conversions."""
    lay: gl.constexpr = gl.BlockedLayout([1, HEADS], [32, 1], [1, 1], [1, 0])
    ch = ch_s.load(gl.SliceLayout(1, lay)).to(gl.int32)
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay))
    rows = gl.load(qt + ch[:, None] * HEADS + heads[None, :])
    return gl.convert_layout(_mul2(rows, gl.load(kscale_ptr + kpage * D + ch)[:, None]), _cols_layout(NB))


@gluon.jit
def _query_rows(qt, q_ptr, b, h, H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr):
    """Q_ROWS: the group's queries times 4 * Q_SCALE as D rows of HEADS fp16 at qt (zeros in the tile's columns past
    the group), which _boosted_rows reads a channel's row at a time. Every program of a (sequence, KV head) writes
    the same bytes there."""
    lay: gl.constexpr = gl.BlockedLayout([1, HEADS], [32, 1], [1, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(1, lay))
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay))
    rows = q_ptr + ((b * H + h) * GROUP + gl.minimum(heads, GROUP - 1)[None, :]).to(gl.int64) * D + d[:, None]
    live = gl.where(heads < GROUP, 4.0 * Q_SCALE, 0.0)[None, :]
    gl.store(qt + d[:, None] * HEADS + heads[None, :], (gl.load(rows).to(gl.float32) * live).to(DOT))


@gluon.jit
def _boosted_operand(ch_s, c, kpage, q_rows, kscale_ptr, D: gl.constexpr, NBC: gl.constexpr, live=None,
                     QT: gl.constexpr = False):
    """The second operand of boosted-channel chunk c (_boosted_fp16 of its NBC channels, in the operand's layout;
    with QT, _boosted_rows from the transposed queries at q_rows)."""
    if QT:
        x = _boosted_rows(ch_s.slice(c * NBC, NBC), kpage, q_rows, kscale_ptr, D, NBC)
    else:
        x = _boosted_fp16(ch_s.slice(c * NBC, NBC), kpage, q_rows, kscale_ptr, D, NBC, live)
    return _b_operand(x, NBC)


@gluon.jit
def _zero_rows(zero_s, K: gl.constexpr):
    """A (16, K) first operand, rows 0-7 the K zeros in zero_s and rows 8-15 ones, columns in operand order: its
    products with p (_b_operand) are the sums of p * zero in rows 0-7 and of p in rows 8-15, one product a 16
    tokens where two products with ones took two (8 HMMA, 16 HMUL2 and 4 FMUL a kitty-pro page fewer), with p * zero
    exact instead of rounded to fp16. The compiler copies the loaded zeros into the products' register quads beside
    the ones (31 more IMAD a page, triton 3.6, cap 168). Measured on the H200 against the two products: the paged
    launch alone 387.2 against 392.6 us at batch 64 / 32K, faster or equal at every shape (BENCHMARKS.md section 1,
    session 33); with _live_heads, faster or equal at every shape on an H100 too (session 35)."""
    lay: gl.constexpr = _rows_layout(K)
    zero = zero_s.load(gl.SliceLayout(0, lay))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, lay))[:, None]
    return _a_operand(gl.where(rows < 8, zero[None, :], 1.0).to(DOT), 16, K)


@gluon.jit
def _value_products(vbufs, s0, s1, s2, s3, m_i, sums, acc0, acc1, acc2, acc3, D: gl.constexpr, G: gl.constexpr,
                    V_BITS: gl.constexpr, I8: gl.constexpr, fold_zq=None, scale=1.0):
    """The online softmax over a page's 4 score quarters (full pages: no token masked) and the value page in vbufs
    accumulated, token quarter i with score quarter i: out^T (channel, head) += codes (channel, token) @ (p * scale)
    (token, head). The sums of p and of p * zero are one product a 16 tokens (_zero_rows), in `sums`, a (16, HEADS)
    tile: rows 0-7 the sum of p * zero, rows 8-15 the sum of p. Returns the new running max, the sums and the 4
    channel quarters' accumulators (channel quarter i times 4^i * 2^-24). The running sums are rescaled on every
    page: skipping the pages that raise no maximum (alpha = 1) saved 44 instructions on them and no time beyond
    noise on the H200 (BENCHMARKS.md section 1, session 14), and no energy on a power-limited H100 (session 45). I8
    (2-bit values, pages of 128): the value products in 8-bit integers, p * scale rounded to s8 with one scale per
    head a page (_i8_value_scale), summed from I8_MAGIC a page. With fp16 products, acc3 sums the whole bytes'
    products (QUARTER_ASM), which are linear in the page sums like the others: the kernel takes the other quarters
    off once, at its end (_quarter3_sums). fold_zq (FOLD_MAX, an experiment): s0 .. s3 are the key products'
    unweighted sums (_key_scores' FOLD), fold_zq the page's zero terms (log2 units) and scale qk_scale / Q_SCALE:
    the page's maximum is taken from each quarter's sums' maximum over the rows a thread holds, times its weight
    (the weights are positive), and each score's weight and the zero term less the running max go into the
    exponent's one multiply-add (_folded_max)."""
    G4: gl.constexpr = G // 4
    D4: gl.constexpr = D // 4
    mma: gl.constexpr = _mma()
    vlow_s, vhigh_s, vscale_s, vzero_s = vbufs
    if fold_zq is None:
        page_max = gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), axis=0)
    else:
        page_max = _folded_max(s0, s1, s2, s3, scale) + fold_zq
    m_new = gl.maximum(m_i, page_max)
    alpha = gl.exp2(m_i - m_new)[None, :]
    sums = sums * alpha
    if I8:
        r = _i8_value_scale(vscale_s, page_max, m_new, G)
        i0 = gl.full([D4, HEADS], I8_MAGIC, gl.int32, mma)
        i1 = gl.full([D4, HEADS], I8_MAGIC, gl.int32, mma)
        i2 = gl.full([D4, HEADS], I8_MAGIC, gl.int32, mma)
        i3 = gl.full([D4, HEADS], I8_MAGIC, gl.int32, mma)
    else:
        acc0 = acc0 * alpha
        acc1 = acc1 * alpha
        acc2 = acc2 * alpha
        acc3 = acc3 * alpha
    scores = (s0, s1, s2, s3)
    tokens: gl.constexpr = gl.SliceLayout(1, _cols_layout(G4))
    if fold_zq is not None:
        offset = (fold_zq - m_new)[None, :]
    for i in gl.static_range(4):
        # the probabilities in fp16, as (token, head) operands, then times the tokens' scales in fp16
        if fold_zq is None:
            x = scores[i] - m_new[None, :]
        else:
            x = scores[i] * (_pick(QUARTER_WEIGHT, i) * scale) + offset
        p = gl.convert_layout(gl.exp2(x).to(DOT), _cols_layout(G4))
        sums = mma_v2(_zero_rows(vzero_s.slice(i * G4, G4), G4), _b_operand(p, G4), sums)
        pv = _mul2(p, vscale_s.slice(i * G4, G4).load(tokens)[:, None])
        codes = vlow_s.slice(i * D4, D4).load(_rows_layout(G4))
        if I8:
            i0, i1, i2, i3 = _i8_tile_products(codes, _i8_round(pv, r[None, :], G4), i0, i1, i2, i3, G4)
        else:
            pv = _b_operand(pv, G4)
            acc0, acc1, acc2, acc3 = _tile_products(codes, pv, acc0, acc1, acc2, acc3, D4, G4)
            if V_BITS == 4:
                pv4 = pv * 4.0                                                     # the high bits weigh 4 (exact)
                acc0, acc1, acc2, acc3 = _tile_products(vhigh_s.slice(i * D4, D4).load(_rows_layout(G4)), pv4,
                                                        acc0, acc1, acc2, acc3, D4, G4)
    if I8:
        # back to the fp16 products' units (code * 4^j * 2^-24) and onto the running sums: two multiply-adds
        k = gl.convert_layout((2.0 ** -24) / r.to(gl.float32), gl.SliceLayout(0, mma))
        acc0 = _i8_accumulate(acc0, alpha, i0, k)
        acc1 = _i8_accumulate(acc1, alpha, i1, k)
        acc2 = _i8_accumulate(acc2, alpha, i2, k)
        acc3 = _i8_accumulate(acc3, alpha, i3, -k)                   # quarter 3 sums -64 * codes (I8_QUARTER_ASM)
    return m_new, sums, acc0, acc1, acc2, acc3


@gluon.jit
def _rows_max(s):
    """An (R, HEADS) accumulator tile's maximum over the rows each thread holds (rows r + 8k of its lanes' r):
    (8, HEADS), its rows on the lanes, without crossing a lane."""
    R: gl.constexpr = s.shape[0]
    return gl.max(gl.reshape(s, [R // 8, 8, HEADS]), axis=0)


@gluon.jit
def _folded_max(s0, s1, s2, s3, scale):
    """FOLD_MAX: the largest weighted score of the 4 quarters' unweighted sums, per head, without the zero term:
    each quarter's maximum over its thread's rows (_rows_max) times its weight QUARTER_WEIGHT[i] * scale (positive),
    then the largest of the 4 and over the lanes. (HEADS,) in the layout of the scores' columns."""
    a = gl.maximum(_rows_max(s0) * (_pick(QUARTER_WEIGHT, 0) * scale),
                   _rows_max(s1) * (_pick(QUARTER_WEIGHT, 1) * scale))
    b = gl.maximum(_rows_max(s2) * (_pick(QUARTER_WEIGHT, 2) * scale),
                   _rows_max(s3) * (_pick(QUARTER_WEIGHT, 3) * scale))
    return gl.convert_layout(gl.max(gl.maximum(a, b), axis=0), gl.SliceLayout(0, _mma()))


# ---------------------------------------------------------------------------------------------- slot buffers
# A slot's tiles are copied into one buffer per kind with cp.async (16 bytes a thread): the next slot's keys as soon
# as this slot's keys are read, its values as soon as this slot's values are read, so that a page's load latency is
# spent on half a page of arithmetic (a second buffer of each, a whole slot ahead, measured 9 % slower: its shared
# memory allows 8 programs per multiprocessor instead of 12; BENCHMARKS.md section 1, session 10). A plane the
# method does not have (no boosted channels, 2-bit values) gets a placeholder that nothing reads, which the compiler
# drops.
@gluon.constexpr_function
def _plane_shared(TMA):
    return _tma_shared(8) if TMA else gl.SwizzledSharedLayout(1, 1, 1, [1, 0])


@gluon.constexpr_function
def _flat_shared():
    return gl.SwizzledSharedLayout(1, 1, 1, [0])


@gluon.constexpr_function
def _plane_shape(R, K, C, PRESENT):
    """A chunked plane's buffer: [K / C * R, C] bytes, chunk c in rows [c * R, (c + 1) * R)."""
    return [K // C * R, C] if PRESENT else [R, 16]


@gluon.jit
def _copy_plane(buf, ptr, page, R: gl.constexpr, K: gl.constexpr):
    """cp.async of page `page`'s (R, K) code plane into buf: both hold it chunk by chunk (layout.py), so it is one
    contiguous run of R * K bytes, 16 a thread and 512 a warp an instruction (whole cache lines; in shared memory
    no bank conflicts: while the planes were stored row by row, a row's chunks landed on the same banks, ncu's 16
    wavefronts an instruction where 4 would do, BENCHMARKS.md section 1, session 16); a plane of fewer than 512
    bytes (16 boosted channels of a 64-token page: 256) takes R * K / 32 a thread, so no lane copies twice."""
    layout: gl.constexpr = gl.BlockedLayout([min(16, R * K // 32)], [32], [1], [0])
    flat = buf._reinterpret(gl.uint8, [R * K], _flat_shared())
    async_copy.async_copy_global_to_shared(flat, ptr + page * (R * K) + gl.arange(0, R * K, layout=layout))


@gluon.jit
def _key_buffers(D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr, TMA: gl.constexpr):
    """Shared memory for a key page's tiles: low plane, high plane, boosted channels, scales, zeros (the planes in
    the layout TMA writes, with TMA)."""
    flat: gl.constexpr = _flat_shared()
    return (gl.allocate_shared_memory(gl.uint8, _plane_shape(G // 4, D, KC, True), _plane_shared(TMA)),
            gl.allocate_shared_memory(gl.uint8, _plane_shape(G // 4, NB, _chunk(max(NB, 16)), NB > 0),
                                      _plane_shared(TMA)),
            gl.allocate_shared_memory(gl.uint8, [max(NB, TMA_ALIGN)], flat).slice(0, max(NB, 16)),
            gl.allocate_shared_memory(gl.float16, [D], flat),
            gl.allocate_shared_memory(gl.float16, [D], flat))


@gluon.jit
def _value_buffers(D: gl.constexpr, G: gl.constexpr, V_BITS: gl.constexpr, TMA: gl.constexpr):
    """Shared memory for a value page's tiles: low plane, high plane, scales, zeros."""
    flat: gl.constexpr = _flat_shared()
    return (gl.allocate_shared_memory(gl.uint8, _plane_shape(D // 4, G, G // 4, True), _plane_shared(TMA)),
            gl.allocate_shared_memory(gl.uint8, _plane_shape(D // 4, G, G // 4, V_BITS == 4), _plane_shared(TMA)),
            gl.allocate_shared_memory(gl.float16, [G], flat),
            gl.allocate_shared_memory(gl.float16, [G], flat))


# ------------------------------------------------------------------------------------------- the same copies by TMA
# decode_attention(kernel="gluon-tma", the default on Hopper): each plane is one TMA box of whole 128-byte rows
# (_tma_plane), each vector a box of one row, all on one mbarrier per kind that counts the page's bytes. Why: cp.async
# wrote a page row's 4 chunks on the same banks while the planes were stored row by row (ncu: 16 shared-memory
# wavefronts an instruction where 4 would do), and its 23 instructions a page carry their own address arithmetic; a
# TMA box is written whole, by one instruction. Measured on the H200 with a box a chunk: 4-11 % faster than cp.async
# at batches 8 and 64, 3 % or less at batch 1, DRAM throughput 64 -> 72 % (ncu; BENCHMARKS.md section 1, session 16,
# call 5); a box a plane took 6 of its 14 barriers and 44 of its 1,428 instructions a page off (session 18).
@gluon.constexpr_function
def _tma_shared(bits, rank=2):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=rank)


TMA_ROW = gl.constexpr(128)         # bytes of a plane box's rows
# TMA's shared-memory destinations must be aligned to 128 bytes. The compiler aligns each allocation to its own
# layout's needs, not to a later reinterpretation's (the vectors are TMA destinations reinterpreted): so every
# allocation is a multiple of TMA_ALIGN bytes, the boosted channels' list and the mbarriers padded to it
TMA_ALIGN = gl.constexpr(128)
BARRIER_SLOTS = gl.constexpr(16)    # 8-byte mbarriers in TMA_ALIGN bytes


@gluon.jit
def _tma_plane(desc, page, bar, buf, CH: gl.constexpr, R: gl.constexpr, C: gl.constexpr):
    """Page `page`'s plane (CH chunks of R rows of C bytes, stored chunk by chunk as buf holds it: layout.py) into
    buf, as one box of its bytes in rows of TMA_ROW (desc: the planes seen as rows of TMA_ROW bytes,
    tma_descriptors). Why whole rows: TMA's boxes of the 32-byte rows of one chunk, which the planes stored row by row
    needed (a 3-D box: chunk, row, column), capped the copies alone at 3,954 GB/s at batch 64 / 32K, where boxes of
    128-byte rows read 4,326 (H200, 2026-12-03, `python -m backend.bench tune --vary loads`, BENCHMARKS.md section 1,
    session 22). Why one box a plane rather than one a chunk: Triton puts a barrier before every TMA copy it issues
    (bar.sync, then one elected thread), 14 a kitty-pro page with a box a chunk, 8 with a box a plane (session
    18)."""
    ROWS: gl.constexpr = CH * R * C // TMA_ROW
    tma.async_copy_global_to_shared(desc, [(page * ROWS).to(gl.int32), 0], bar,
                                    buf._reinterpret(gl.uint8, [ROWS, TMA_ROW], _tma_shared(8)))


@gluon.jit
def _tma_vector(desc, row, bar, buf, N: gl.constexpr, DTYPE: gl.constexpr, BITS: gl.constexpr):
    """Row `row` of a (rows, N) tensor into the flat vector buf."""
    tma.async_copy_global_to_shared(desc, [row, 0], bar, buf._reinterpret(DTYPE, [1, N], _tma_shared(BITS)))


@gluon.jit
def _tma_keys(kbufs, bar, kpage, klow_d, khigh_d, kch_d, kscale_d, kzero_d, D: gl.constexpr, G: gl.constexpr,
              NB: gl.constexpr, ZEROS: gl.constexpr = True):
    """TMA of key page `kpage`'s tiles into kbufs, counted on mbarrier bar (its zeros only where ZEROS: without,
    ZQ_AHEAD, nothing reads them there)."""
    klow_s, khigh_s, ch_s, kscale_s, kzero_s = kbufs
    G4: gl.constexpr = G // 4
    mbarrier.expect(bar, G4 * (D + NB) + NB + (4 if ZEROS else 2) * D)
    _tma_plane(klow_d, kpage, bar, klow_s, D // KC, G4, KC)
    _tma_vector(kscale_d, kpage.to(gl.int32), bar, kscale_s, D, gl.float16, 16)
    if ZEROS:
        _tma_vector(kzero_d, kpage.to(gl.int32), bar, kzero_s, D, gl.float16, 16)
    if NB > 0:
        NBC: gl.constexpr = _chunk(NB)
        _tma_plane(khigh_d, kpage, bar, khigh_s, NB // NBC, G4, NBC)
        _tma_vector(kch_d, kpage.to(gl.int32), bar, ch_s, NB, gl.uint8, 8)


@gluon.jit
def _tma_values(vbufs, bar, vpage, vlow_d, vhigh_d, vscale_d, vzero_d, D: gl.constexpr, G: gl.constexpr,
                V_BITS: gl.constexpr):
    """TMA of value page `vpage`'s tiles into vbufs, counted on mbarrier bar."""
    vlow_s, vhigh_s, vscale_s, vzero_s = vbufs
    D4: gl.constexpr = D // 4
    G4: gl.constexpr = G // 4
    mbarrier.expect(bar, D4 * G * (V_BITS // 2) + 4 * G)
    _tma_plane(vlow_d, vpage, bar, vlow_s, 4, D4, G4)
    if V_BITS == 4:
        _tma_plane(vhigh_d, vpage, bar, vhigh_s, 4, D4, G4)
    _tma_vector(vscale_d, vpage.to(gl.int32), bar, vscale_s, G, gl.float16, 16)
    _tma_vector(vzero_d, vpage.to(gl.int32), bar, vzero_s, G, gl.float16, 16)


@gluon.jit
def _barrier_pair():
    """Two initialised mbarriers (a key and a value buffer's), visible to TMA. One allocation of TMA_ALIGN bytes,
    like every other one of the kernel a multiple of TMA_ALIGN: so no buffer that TMA writes lands off TMA's
    alignment (with a second value buffer, an allocation of 16 bytes before kitty's 16 boosted channels' list put it
    there: "misaligned address" on the H200, BENCHMARKS.md section 1, session 27)."""
    bars = gl.allocate_shared_memory(gl.int64, [BARRIER_SLOTS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    return bars.index(0), bars.index(1)


@gluon.jit
def _fetch_keys(kbufs, kbar, kpage, klow, khigh, kch, kscale, kzero, D: gl.constexpr, G: gl.constexpr,
                NB: gl.constexpr, TMA: gl.constexpr, ZEROS: gl.constexpr = True):
    """Key page `kpage` on its way into kbufs: by TMA on kbar (klow...: tensor descriptors), or as one cp.async
    group (klow...: pointers); its zeros only where ZEROS."""
    if TMA:
        _tma_keys(kbufs, kbar, kpage, klow, khigh, kch, kscale, kzero, D, G, NB, ZEROS)
    else:
        _copy_keys(kbufs, kpage, klow, khigh, kch, kscale, kzero, D, G, NB, ZEROS)


@gluon.jit
def _fetch_values(vbufs, vbar, vpage, vlow, vhigh, vscale, vzero, D: gl.constexpr, G: gl.constexpr,
                  V_BITS: gl.constexpr, TMA: gl.constexpr):
    """Value page `vpage` on its way into vbufs, as _fetch_keys."""
    if TMA:
        _tma_values(vbufs, vbar, vpage, vlow, vhigh, vscale, vzero, D, G, V_BITS)
    else:
        _copy_values(vbufs, vpage, vlow, vhigh, vscale, vzero, D, G, V_BITS)


@gluon.jit
def _commit(TMA: gl.constexpr):
    """Close a cp.async group (every slot commits one per kind, empty or not, so that wait_group(1) counts
    slots); TMA counts bytes on its mbarriers instead."""
    if not TMA:
        async_copy.commit_group()


@gluon.jit
def _arrived(bar, phase, TMA: gl.constexpr):
    """Wait for the oldest buffer in flight: its mbarrier's phase with TMA, else all but the newest cp.async
    group."""
    if TMA:
        mbarrier.wait(bar, phase)
    else:
        async_copy.wait_group(1)


@gluon.jit
def _waited(bar, phase, TMA: gl.constexpr, cycles, WAITS: gl.constexpr):
    """_arrived, and cycles plus the clock cycles it took where WAITS (the kernel's measurement), else cycles."""
    if WAITS:
        start = _clock()
        _arrived(bar, phase, TMA)
        return cycles + (_clock() - start)
    else:
        _arrived(bar, phase, TMA)
        return cycles


@gluon.jit
def _copy_keys(kbufs, kpage, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, D: gl.constexpr,
               G: gl.constexpr, NB: gl.constexpr, ZEROS: gl.constexpr = True):
    """cp.async of key page `kpage`'s tiles into kbufs (its zeros only where ZEROS)."""
    klow_s, khigh_s, ch_s, kscale_s, kzero_s = kbufs
    _copy_plane(klow_s, klow_ptr, kpage, G // 4, D)
    _copy_vector(kscale_s, kscale_ptr + kpage * D, D, 2)
    if ZEROS:
        _copy_vector(kzero_s, kzero_ptr + kpage * D, D, 2)
    if NB > 0:
        _copy_plane(khigh_s, khigh_ptr, kpage, G // 4, NB)
        _copy_vector(ch_s, kch_ptr + kpage * NB, NB, 1)


@gluon.jit
def _copy_values(vbufs, vpage, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, D: gl.constexpr, G: gl.constexpr,
                 V_BITS: gl.constexpr):
    """cp.async of value page `vpage`'s tiles into vbufs."""
    vlow_s, vhigh_s, vscale_s, vzero_s = vbufs
    _copy_plane(vlow_s, vlow_ptr, vpage, D // 4, G)
    if V_BITS == 4:
        _copy_plane(vhigh_s, vhigh_ptr, vpage, D // 4, G)
    _copy_vector(vscale_s, vscale_ptr + vpage * G, G, 2)
    _copy_vector(vzero_s, vzero_ptr + vpage * G, G, 2)


@gluon.constexpr_function
def _queries_shared():
    """(chunks, KC, HEADS) fp16 queries, each head's KC channels contiguous: a quarter warp's 16-byte reads in
    _cols_layout(KC) cover 128 contiguous bytes (no bank conflicts)."""
    return gl.SwizzledSharedLayout(1, 1, 1, [0, 1])


# triton 3.7 calls gl.thread_barrier (3.6, the H200's version) gl.barrier
_BARRIER = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _first_slots(b, h, part, ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr, KMP, VMP, NSPLIT, klow_ptr, khigh_ptr, kch_ptr,
                 kscale_ptr, kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, kbar, vbar, H: gl.constexpr,
                 D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr, V_BITS: gl.constexpr, TMA: gl.constexpr,
                 ZEROS: gl.constexpr = True):
    """Program (b, h, part)'s paged slots [start, end) (the Triton kernel's _program_slots split), its slot buffers
    with the first slot's pages on their way (keys then values: _fetch_keys; the keys' zeros where ZEROS), and the
    page ids the loop starts from: (start, end, last, ktab, vtab, kbufs, vbufs, kpage, kpage_next, vpage_next)."""
    n_paged = gl.minimum(gl.load(nkp_ptr + b), gl.load(nvp_ptr + b))
    per_split = gl.cdiv(n_paged, NSPLIT)
    start = part * per_split
    end = gl.minimum(start + per_split, n_paged)
    last = gl.maximum(end - 1, 0)
    ktab = ktab_ptr + b * KMP
    vtab = vtab_ptr + b * VMP
    kbufs = _key_buffers(D, G, NB, TMA)
    vbufs = _value_buffers(D, G, V_BITS, TMA)
    kpage = gl.load(ktab + start, mask=start < end, other=0).to(gl.int64) * H + h
    vpage = gl.load(vtab + start, mask=start < end, other=0).to(gl.int64) * H + h
    if start < end:
        _fetch_keys(kbufs, kbar, kpage, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, D, G, NB, TMA, ZEROS)
        _commit(TMA)
        _fetch_values(vbufs, vbar, vpage, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, D, G, V_BITS, TMA)
        _commit(TMA)
    # the next slot's page ids (the copies' addresses); each iteration loads the one after, a slot before its use.
    # A program without slots reads no table entry (a sequence's row may have none)
    kpage_next = gl.load(ktab + gl.minimum(start + 1, last), mask=start < end, other=0).to(gl.int64) * H + h
    vpage_next = gl.load(vtab + gl.minimum(start + 1, last), mask=start < end, other=0).to(gl.int64) * H + h
    return start, end, last, ktab, vtab, kbufs, vbufs, kpage, kpage_next, vpage_next


@gluon.jit
def _queries(q_ptr, b, h, H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, lay: gl.constexpr,
             shared: gl.constexpr, live=None):
    """The group's queries times Q_SCALE in fp16, chunk by chunk into shared memory (D / KC, KC, HEADS) written
    from registers in `lay`, times `live` if given (_live_heads: zero in the tile's columns past the group). Returns
    (1, HEADS) pointers to the query rows (in `lay`) and the shared memory. Those columns' pointers take the group's
    last head's row, so that their loads need no mask (masked, the boosted channels' gathers cost 8 byte permutes a
    kitty-pro page more, the masked loads' defaults, and 6 registers), and `live` zeroes what they load."""
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay))
    q_rows = q_ptr + ((b * H + h) * GROUP + gl.minimum(heads, GROUP - 1)[None, :]).to(gl.int64) * D
    q_s = gl.allocate_shared_memory(DOT, [D // KC, KC, HEADS], shared)
    d = gl.arange(0, KC, layout=gl.SliceLayout(1, lay))
    factor = Q_SCALE
    if live is not None:
        factor = live * Q_SCALE
    for c in gl.static_range(D // KC):
        q_s.index(c).store((gl.load(q_rows + c * KC + d[:, None]) * factor).to(DOT))
    return q_rows, q_s


@gluon.jit
def _live_heads(GROUP: gl.constexpr, lay: gl.constexpr):
    """(1, HEADS) fp32 in `lay`: 1 for the group's heads, 0 for the tile's padding columns past it (a group of 4 fills
    4 of the matrix unit's 8). The queries in shared memory (_queries) and the fp16 kernels' boosted channels'
    gathered ones (_key_scores) are multiplied by it, and the padding heads' running max starts at PAD_HEAD_MAX:
    every fp16 second operand is zero in those columns. Measured on the H200 against copies of the group's last head
    there (kitty-pro at batch 64 / 32K): the arithmetic alone drew 400 W instead of 426 at the same clock and time,
    and the power-capped paged launch ran 30 MHz faster, 383.7 against 392.6 us (faster or equal at every shape, the
    group's numbers the same bit for bit; BENCHMARKS.md section 1, session 33); with _zero_rows, faster or equal at
    every shape on an H100 too (session 35)."""
    return gl.where(gl.arange(0, HEADS, layout=gl.SliceLayout(0, lay)) < GROUP, 1.0, 0.0)[None, :]


# the running max that the padding heads start at: 2^(score - PAD_HEAD_MAX) is 0 for any score a page can have, and
# finite, so that alpha = 2^(PAD_HEAD_MAX - PAD_HEAD_MAX) is 1, not NaN: their probabilities are 0 on every page
PAD_HEAD_MAX = gl.constexpr(1.0e30)


@gluon.jit
def _slot(slot, end, last, ktab, vtab, h, kbufs, vbufs, kbar, vbar, keys, values, q_s, q_rows, qk_scale, kscale_rows,
          live, zq_row, pad_zero, pipeline, state, H: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
          NB: gl.constexpr, V_BITS: gl.constexpr, TMA: gl.constexpr, I8: gl.constexpr, FOLD: gl.constexpr,
          COMPUTE: gl.constexpr, COPIES: gl.constexpr, WAITS: gl.constexpr, PAD: gl.constexpr, PAD_N: gl.constexpr,
          QT: gl.constexpr = False):
    """Paged slot `slot` of _gluon_paged_kernel's loop (its arguments; keys / values: the page tensors' pointers or
    descriptors; zq_row: the slot's keys' zero terms, ZQ_AHEAD, or None; QT: q_rows is the transposed queries,
    Q_ROWS): wait for its keys, their scores, refill the
    key buffer with the next slot's, wait for its values, the softmax and value products, refill the value buffer.
    pipeline: (phase, this slot's key page, the next slot's key and value pages, key and value waits), state: (running
    max, the sums of p and of p * zero, the 4 accumulators); returns both after the slot."""
    phase, kpage, kpage_next, vpage_next, key_wait, value_wait = pipeline
    m_i, sums, acc0, acc1, acc2, acc3 = state
    klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr = keys
    vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr = values
    more = COPIES and slot + 1 < end
    kpage_after = gl.load(ktab + gl.minimum(slot + 2, last)).to(gl.int64) * H + h
    vpage_after = gl.load(vtab + gl.minimum(slot + 2, last)).to(gl.int64) * H + h
    if COPIES:
        # this slot's keys are in (its values may not be)
        key_wait = _waited(kbar, phase, TMA, key_wait, WAITS)
    _BARRIER()                                      # ... for every lane (and, the first time, the queries)
    if not COMPUTE:
        pass
    elif I8 > 0:
        s0, s1, s2, s3 = _key_scores_i8(kbufs, kpage, q_s, q_rows, qk_scale, kscale_rows, D, G, NB, zq_row)
    else:
        s0, s1, s2, s3 = _key_scores(kbufs, kpage, q_s, q_rows, qk_scale, kscale_rows, D, G, NB, live, zq_row, FOLD,
                                     QT)
        if PAD_N > 0:
            s0 = _pad(s0, pad_zero, PAD, PAD_N)
    _BARRIER()                                      # every lane's key reads are done: refill the key buffer
    if more:
        _fetch_keys(kbufs, kbar, kpage_next, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr, D, G, NB, TMA,
                    zq_row is None)
    _commit(TMA)
    if COPIES:
        # this slot's values are in (the next slot's keys may not be)
        value_wait = _waited(vbar, phase, TMA, value_wait, WAITS)
    _BARRIER()
    if COMPUTE:
        fold_zq = None
        if FOLD:
            fold_zq = zq_row
        m_i, sums, acc0, acc1, acc2, acc3 = _value_products(vbufs, s0, s1, s2, s3, m_i, sums, acc0, acc1, acc2,
                                                            acc3, D, G, V_BITS, I8 == 2, fold_zq,
                                                            qk_scale * (1.0 / Q_SCALE))
    _BARRIER()                                      # the value reads are done: refill the value buffer
    if more:
        _fetch_values(vbufs, vbar, vpage_next, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, D, G, V_BITS, TMA)
    _commit(TMA)
    return ((phase ^ 1, kpage_next, kpage_after, vpage_after, key_wait, value_wait),
            (m_i, sums, acc0, acc1, acc2, acc3))




@gluon.jit(do_not_specialize=["KMP", "VMP", "NSPLIT", "NPART", "pad_zero"])
def _gluon_paged_kernel(
        q_ptr, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, kscale_rows, kzero_rows,
        ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr, qt_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, KMP, VMP, NSPLIT, NPART,
        H: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, G: gl.constexpr, NB: gl.constexpr,
        V_BITS: gl.constexpr, TMA: gl.constexpr, I8: gl.constexpr = 0, ZQ_AHEAD: gl.constexpr = False,
        FOLD_MAX: gl.constexpr = False, Q_ROWS: gl.constexpr = False, PDL: gl.constexpr = False,
        COMPUTE: gl.constexpr = True, COPIES: gl.constexpr = True, times_ptr=None, WAITS: gl.constexpr = False,
        PAD: gl.constexpr = "", PAD_N: gl.constexpr = 0, pad_zero=0):
    """Program (b, h, part < NSPLIT): the paged slots [start, end) of sequence b, KV head h (the Triton kernel's
    _program_slots split), written as partial (output, max, sum) number `part`. klow_ptr ... vzero_ptr: the page
    tensors, as pointers or, with TMA (decode_attention(kernel="gluon-tma")), as tensor descriptors; kscale_rows /
    kzero_rows: the key scales and zeros as pointers, for the boosted channels' gather and ZQ_AHEAD's. The tile's
    columns past the group get zero operands (_live_heads). Experiments (decode_attention.GLUON_EXPERIMENTS):
    ZQ_AHEAD, the keys' zero terms a window of ZQ_SLOTS slots at a time, 16 pages a product (_zero_terms), the loop
    over slots (_slot) nested in a loop over windows; FOLD_MAX (with ZQ_AHEAD), the scores' weights and zero term in
    the exponent (_folded_max); Q_ROWS, the boosted channels' queries read from the program's transposed copy at
    qt_ptr (D * HEADS fp16 a (sequence, KV head), _query_rows, _boosted_rows). PDL: the remaining blocks' kernel after
    it may start at once (decode_launches' pdl).
    Two measurements that are not attention (`python -m backend.bench tune --vary loads`): COMPUTE=False, the page
    loop's copies, waits and barriers only (the memory pipeline's own ceiling); COPIES=False, its products and
    barriers only, over the first slot's pages again and again (the arithmetic's own time). times_ptr (a
    measurement, `bench tune --vary timeline`): each program writes when it started and ended (%globaltimer, ns) and
    its multiprocessor, TIMES_ROW int64 a program in grid order; with WAITS also the clock cycles it spent waiting
    for its key pages and for its value pages (their mbarriers) and its cycles from start to end (%clock64, read
    around each wait: the page loop changes). PAD / PAD_N (a measurement, `bench tune --vary pad`): PAD_N more
    instructions a page of one kind ("alu": LOP3, "fma": FFMA, "mma": HMMA) on the scores, that add nothing
    (pad_zero, 0 at run time, masks them out): what one more instruction of each kind costs this kernel (_pad)."""
    if times_ptr is not None:
        started = _globaltimer()
    key_wait = 0                                    # WAITS: cycles waited for key pages, for value pages
    value_wait = 0
    if WAITS:
        began = _clock()
        key_wait = began - began
        value_wait = key_wait
    if PDL:
        _launch_dependents()
    b = gl.program_id(0)
    h = gl.program_id(1)
    part = gl.program_id(2)
    G4: gl.constexpr = G // 4
    D4: gl.constexpr = D // 4
    if TMA:
        kbar, vbar = _barrier_pair()
    else:
        kbar = 0                                    # cp.async groups need no barrier
        vbar = 0
    ZQ: gl.constexpr = ZQ_AHEAD and COMPUTE
    FOLD: gl.constexpr = FOLD_MAX and ZQ and I8 == 0              # decode_attention.kernel_parts: with zq-ahead
    start, end, last, ktab, vtab, kbufs, vbufs, kpage, kpage_next, vpage_next = _first_slots(
        b, h, part, ktab_ptr, vtab_ptr, nkp_ptr, nvp_ptr, KMP, VMP, NSPLIT, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
        kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, kbar, vbar, H, D, G, NB, V_BITS, TMA, not ZQ)
    zq_s = _zero_term_buffer(ZQ)
    mma: gl.constexpr = _mma()
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
    live = None                                     # zeros in the tile's columns past the group (_live_heads)
    if GROUP < HEADS:
        live = _live_heads(GROUP, _cols_layout(KC))
    q_rows, q_s = _queries(q_ptr, b, h, H, GROUP, D, _cols_layout(KC), _queries_shared(), live)
    QT: gl.constexpr = Q_ROWS and NB > 0 and I8 == 0                # decode_attention.kernel_parts: fp16 products
    if QT:
        q_rows = qt_ptr + (b * H + h).to(gl.int64) * (D * HEADS)
        _query_rows(q_rows, q_ptr, b, h, H, GROUP, D)
        _BARRIER()                                  # every lane's rows are written (and visible) before any reads
    # the padding heads' running max starts above any score: their probabilities are 0 on every page (and their
    # running sums stay 0: alpha is 2^0), so the value products' second operands are zero there too
    m_i = gl.where(heads < GROUP, float("-inf"), PAD_HEAD_MAX)
    sums = gl.zeros([16, HEADS], gl.float32, mma)   # sums of p * zero (rows 0-7) and of p (rows 8-15): _zero_rows
    acc0 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc1 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc2 = gl.zeros([D4, HEADS], gl.float32, mma)
    acc3 = gl.zeros([D4, HEADS], gl.float32, mma)
    phase = 0
    if not COPIES:                                  # the first slot's pages, then no copies and no waits
        _arrived(kbar, 0, TMA)
        _arrived(vbar, 0, TMA)
    keys = (klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr)
    values = (vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr)
    pipeline = (phase, kpage, kpage_next, vpage_next, key_wait, value_wait)
    state = (m_i, sums, acc0, acc1, acc2, acc3)
    if ZQ:
        # windows of ZQ_SLOTS slots, each one's keys' zero terms first (the page loop the inner one: what a page costs
        # stays the loop that kernels.sass_profile counts)
        for first in range(start, end, ZQ_SLOTS):
            _BARRIER()                              # the queries (the first time), every lane's reads of the terms
            _zero_terms(zq_s, q_s, ktab, first, end, kzero_rows, h, qk_scale * (1.0 / Q_SCALE), H, D)
            _BARRIER()
            for slot in range(first, gl.minimum(first + ZQ_SLOTS, end)):
                pipeline, state = _slot(slot, end, last, ktab, vtab, h, kbufs, vbufs, kbar, vbar, keys, values, q_s,
                                        q_rows, qk_scale, kscale_rows, live, _zero_term(zq_s, slot - first),
                                        pad_zero, pipeline, state, H, D, G, NB, V_BITS, TMA, I8, FOLD, COMPUTE,
                                        COPIES, WAITS, PAD, PAD_N, QT)
    else:
        for slot in range(start, end):
            pipeline, state = _slot(slot, end, last, ktab, vtab, h, kbufs, vbufs, kbar, vbar, keys, values, q_s,
                                    q_rows, qk_scale, kscale_rows, live, None, pad_zero, pipeline, state, H, D, G, NB,
                                    V_BITS, TMA, I8, FOLD, COMPUTE, COPIES, WAITS, PAD, PAD_N, QT)
    key_wait, value_wait = pipeline[4], pipeline[5]
    m_i, sums, acc0, acc1, acc2, acc3 = state
    if not TMA:
        async_copy.wait_group(0)

    hmask = heads < GROUP
    idx = ((b * H + h) * GROUP + heads).to(gl.int64) * NPART + part
    gl.store(pm_ptr + idx, m_i, mask=hmask)
    # each half of the sums' rows holds one sum 8 times: the largest of them is it
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))[:, None]
    gl.store(pl_ptr + idx, gl.max(gl.where(rows < 8, float("-inf"), sums), axis=0), mask=hmask)
    c = gl.arange(0, D4, layout=gl.SliceLayout(1, mma))
    out = po_ptr + idx[None, :] * D + c[:, None]
    omask = (c < D4)[:, None] & hmask[None, :]
    zrow = gl.max(gl.where(rows < 8, sums, float("-inf")), axis=0)[None, :]
    if I8 < 2:
        acc3 = _quarter3_sums(acc0, acc1, acc2, acc3)
    gl.store(out, acc0 * _pick(QUARTER_WEIGHT, 0) + zrow, mask=omask)
    gl.store(out + D4, acc1 * _pick(QUARTER_WEIGHT, 1) + zrow, mask=omask)
    gl.store(out + 2 * D4, acc2 * _pick(QUARTER_WEIGHT, 2) + zrow, mask=omask)
    gl.store(out + 3 * D4, acc3 * _pick(QUARTER_WEIGHT, 3) + zrow, mask=omask)
    if times_ptr is not None:
        row = times_ptr + ((b * H + h) * NSPLIT + part).to(gl.int64) * TIMES_ROW
        gl.store(row, started)
        gl.store(row + 1, _globaltimer())
        gl.store(row + 2, _smid().to(gl.int64))
        if WAITS:
            gl.store(row + 3, key_wait)
            gl.store(row + 4, value_wait)
            gl.store(row + 5, _clock() - began)


@gluon.constexpr_function
def _pad_asm(kind, n):
    """n instructions of `kind` on a register of x ($1) that leave it as it was, given $2 = 0 at run time (which
    the compiler cannot know): a chain a = f(a, $2, $1), then $0 = x from a and $2."""
    step, last = {"alu": ("lop3.b32 a, a, $2, $1, 0x96;", "and.b32 a, a, $2; xor.b32 $0, $1, a;"),
                  "fma": ("fma.rn.f32 a, a, $2, $1;", "fma.rn.f32 $0, a, $2, $1;")}[kind]
    return "{ .reg .b32 a; mov.b32 a, $1; " + step * n + last + " }"


@gluon.jit
def _pad(x, zero, KIND: gl.constexpr, N: gl.constexpr):
    """x, a (G/4, HEADS) score tile, through N more instructions of KIND a page (see _gluon_paged_kernel's PAD), in
    independent chains of its elements (N / 8 each, 8 a thread at pages of 128) or, for "mma", N products of ones
    and a zero operand added to it (the compiler computes the tile's equal 16-row halves once: one instruction a
    product; kernels.sass_profile counts them)."""
    R: gl.constexpr = x.shape[0]
    if KIND == "mma":
        ones = gl.full([R, 16], 1.0, DOT, gl.DotOperandLayout(0, _mma(), 2))
        b = gl.full([16, HEADS], 1.0, DOT, gl.DotOperandLayout(1, _mma(), 2)) * zero.to(DOT)
        acc = gl.zeros(x.shape, gl.float32, _mma())
        for i in gl.static_range(N):
            acc = mma_v2(ones, b, acc)
        return x + acc
    else:
        per: gl.constexpr = N * 32 // (R * HEADS)
        z = gl.full(x.shape, 0, gl.int32, x.type.layout) + zero
        if KIND == "fma":
            z = z.to(gl.float32)
        else:
            x = x.to(gl.int32, bitcast=True)
        y = gl.inline_asm_elementwise(_pad_asm(KIND, per), "=r,r,r", [x, z], dtype=x.dtype, is_pure=False, pack=1)
        return y.to(gl.float32, bitcast=True)


@gluon.jit
def _globaltimer():
    """The GPU's nanosecond clock, read when the program gets here."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _clock():
    """The multiprocessor's cycle counter, read when the program gets here."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _smid():
    """The multiprocessor the program runs on."""
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _launch_dependents():
    """griddepcontrol.launch_dependents: the grid launched after this one by programmatic dependent launch may start
    once every program here has run this (a no-op without it)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


SHARED_PER_SM = 228 * 1024          # H100 / H200: shared memory of a multiprocessor, and what each program reserves
SHARED_RESERVED = 1024
CONVERT_SCRATCH = 512               # the probabilities' layout conversion, one token quarter at a time
TMA_BARRIERS = 128                  # the mbarriers' allocation (BARRIER_SLOTS)


def shared_bytes(kv: PagedKV, head_dim: int, use_tma: bool = False, zq_ahead: bool = False) -> int:
    """Shared memory of one program of _gluon_paged_kernel: the queries, a slot's buffers (the boosted channels'
    list padded to TMA_ALIGN), the conversion scratch and, with TMA, the mbarriers' allocation (the placeholders of
    planes the method lacks are never used, and the compiler drops them; tests/test_kernels.py checks this against
    compiled kernels); with zq_ahead (ZQ_AHEAD), the window of the keys' zero terms instead of the keys' zeros."""
    g, nb, d = kv.page_size, kv.n_boost, head_dim
    key = g // 4 * (d + nb) + (max(nb, TMA_ALIGN.value) if nb else 0) + (2 if zq_ahead else 4) * d
    value = d // 4 * g * (kv.v_bits // 2) + 4 * g
    terms = ZQ_SLOTS.value * HEADS_PER_TILE * 4 if zq_ahead else 0
    return 16 * d + CONVERT_SCRATCH + key + value + terms + (TMA_BARRIERS if use_tma else 0)


def resident_programs(kv: PagedKV, head_dim: int, maxnreg: int, zq_ahead: bool = False) -> int:
    """Programs of _gluon_paged_kernel resident on a multiprocessor: bounded by registers and by shared memory
    (shared_bytes; zq_ahead: ZQ_AHEAD's). A warp's registers come from one of the 4 schedulers' files of 16,384 (in
    steps of 8 a thread), so 129 to 170 registers a thread leave 3 warps a scheduler, 12 one-warp programs (ncu on
    the H200 at 144 and 168 registers: BENCHMARKS.md section 1, session 11), not 65,536 / (32 * maxnreg)."""
    by_registers = 4 * (16384 // (32 * (-(-maxnreg // 8) * 8)))
    by_shared = SHARED_PER_SM // (shared_bytes(kv, head_dim, zq_ahead=zq_ahead) + SHARED_RESERVED)
    return max(1, min(by_registers, by_shared))


def tma_descriptors(kv: PagedKV, head_dim: int) -> tuple:
    """The page tensors as the TMA path reads them: each plane as rows of TMA_ROW bytes with a box of a page's plane
    (_tma_plane; a page's plane is one contiguous run, layout.py), each vector a 2-D view (page x head, element) with
    a box of one row. A plane the method lacks gets the low plane's descriptor (never read)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    g, nb, d = kv.page_size, kv.n_boost, head_dim

    def vector(t, columns, bits):
        return TensorDescriptor.from_tensor(t.view(-1, columns), [1, columns], _tma_shared(bits))

    def plane(t, plane_bytes):
        rows = TMA_ROW.value
        return TensorDescriptor.from_tensor(t.view(-1, rows), [plane_bytes // rows, rows], _tma_shared(8))

    klow = plane(kv.k_low, g // 4 * d)
    vlow = plane(kv.v_low, d // 4 * g)
    khigh = plane(kv.k_high, g // 4 * nb) if nb else klow
    return (klow, khigh, vector(kv.k_ch, nb, 8) if nb else klow, vector(kv.k_scale, d, 16),
            vector(kv.k_zero, d, 16), vlow, plane(kv.v_high, d // 4 * g) if kv.v_bits == 4 else vlow,
            vector(kv.v_scale, g, 16), vector(kv.v_zero, g, 16))


def page_tensors(kv: PagedKV) -> tuple:
    """The page tensors in the order _gluon_paged_kernel takes them (klow_ptr ... vzero_ptr)."""
    return kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero, kv.v_low, kv.v_high, kv.v_scale, kv.v_zero


def kernel_arguments(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, num_splits: int,
                     use_tma: bool = False, descriptors: tuple | None = None, i8: int = 0,
                     query_rows: torch.Tensor | None = None, **experiments: bool) -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _gluon_paged_kernel: programs (b, h, part < num_splits) of
    decode_attention's split, q (B, HQ, D), qk_scale = sm_scale * log2(e), parts the (output, max, sum) partials,
    use_tma the TMA copies (with `descriptors`, kv's tma_descriptors made earlier; else made here), i8 the kernel's
    I8, experiments its experiments' flags by kernel_options' names (zq_ahead: ZQ_AHEAD, ...), query_rows the
    transposed queries' workspace that Q_ROWS writes and reads (query_rows_shape; without it, q stands in, unread).
    Also used to compile the kernel for a profile (kernels.sass_profile)."""
    part_o, part_m, part_l = parts
    hq, d = q.shape[1:]
    h = kv.k_fp.shape[1]
    pages = (descriptors or tma_descriptors(kv, d)) if use_tma else page_tensors(kv)
    if experiments.get("q_rows") and query_rows is None:
        from .decode_attention import DecodeWorkspace
        query_rows = DecodeWorkspace().query_rows(q, kv)
    args = (q, *pages, kv.k_scale, kv.k_zero, kv.k_table, kv.v_table, kv.n_kpages, kv.n_vpages,
            q if query_rows is None else query_rows, part_o, part_m, part_l, qk_scale, kv.k_table.shape[1],
            kv.v_table.shape[1], num_splits, part_m.shape[2])
    constants = dict(H=h, GROUP=hq // h, D=d, G=kv.page_size, NB=kv.n_boost, V_BITS=kv.v_bits, TMA=use_tma,
                     I8=i8, **{name.upper(): on for name, on in experiments.items()})
    return args, constants


def query_rows_shape(q: torch.Tensor, kv: PagedKV) -> tuple[int, ...]:
    """The transposed queries' workspace of Q_ROWS ("q-rows"): (sequences, KV heads, head_dim, HEADS_PER_TILE)."""
    return (q.shape[0], kv.k_fp.shape[1], q.shape[-1], HEADS_PER_TILE)


def supports_tma(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether the TMA copies take this launch (besides supports): a Hopper GPU (the only kind they were measured
    on), and the shapes that takes_shapes("gluon-tma", ...) names."""
    return (supports(q, kv) and torch.cuda.get_device_capability(q.device)[0] == 9
            and takes_shapes("gluon-tma", q, kv))


# decode_attention's Gluon kernels (decode_attention.GLUON_KERNELS) -> the kernel's I8: 0 fp16 operands, 1 the key
# products in 8-bit integers, 2 the value products too
I8_PRODUCTS = {"gluon": 0, "gluon-tma": 0, "gluon-tma-i8k": 1, "gluon-tma-i8": 2}


def kernel_options(kernel: str) -> dict:
    """decode_attention's Gluon `kernel`, with the experiments its name adds (decode_attention.kernel_parts) ->
    launch's (and kernel_arguments') options that make it: use_tma, i8, zq_ahead, fold_max, q_rows."""
    from .decode_attention import GLUON_EXPERIMENTS, kernel_parts
    base, extras = kernel_parts(kernel)
    return dict(use_tma=base != "gluon", i8=I8_PRODUCTS[base],
                **{e.replace("-", "_"): e in extras for e in GLUON_EXPERIMENTS})


def supports_kernel(kernel: str, q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether decode_attention's Gluon `kernel` takes this launch: supports (supports_tma with TMA copies) and
    takes_shapes."""
    device = supports_tma(q, kv) if kernel_options(kernel)["use_tma"] else supports(q, kv)
    return device and takes_shapes(kernel, q, kv)


def launch(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, num_splits: int, maxnreg: int,
           use_tma: bool = False, descriptors: tuple | None = None, pdl: bool = False, i8: int = 0,
           compute: bool = True, copies: bool = True, times: torch.Tensor | None = None, waits: bool = False,
           pad: tuple[str, int] | None = None, query_rows: torch.Tensor | None = None, **experiments: bool) -> None:
    """Run _gluon_paged_kernel (see kernel_arguments) with a register cap per thread (255: the compiler's); pdl: its
    programs let the next grid start beside them (its PDL); i8: the 8-bit products (I8_PRODUCTS, with TMA only);
    experiments: the experiments' flags (kernel_options: zq_ahead, fold_max, q_rows; query_rows: q_rows' workspace,
    query_rows_shape, allocated here if not given).
    Measurements, not attention: compute=False, the copies alone; copies=False, the arithmetic alone; times (int64,
    TIMES_ROW a program), each program's start, end and multiprocessor, and with waits its cycles waiting for keys
    and for values and in all (WAITS); pad (kind, instructions a page): the kernel's PAD / PAD_N."""
    args, constants = kernel_arguments(q, kv, qk_scale, parts, num_splits, use_tma, descriptors, i8, query_rows,
                                       **experiments)
    _gluon_paged_kernel[(q.shape[0], kv.k_fp.shape[1], num_splits)](
        *args, **constants, PDL=pdl, COMPUTE=compute, COPIES=copies, times_ptr=times, WAITS=waits,
        **({"PAD": pad[0], "PAD_N": pad[1]} if pad else {}), num_warps=1,
        **({"maxnreg": maxnreg} if maxnreg < 255 else {}))
