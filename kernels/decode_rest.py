"""Decode attention over the blocks of a sequence that are not paged slots: the sink, and the slots after the last
one with both a key page and a value page (a key page whose values are still in the FP16 window, the key and value
Q-buffers, everything of a 16-bit side).

The paged slots' kernels (decode_attention.py's Triton kernel, decode_gluon.py) walk many pages a program; these
blocks are few and short. They are taken REST_TOKENS tokens at a time: a block's keys, values and queries are loaded
at once (as dense (tokens, channels) tiles: a key page's token t is row t % (G/4) of its planes at bit
2 * (t // (G/4)), a value page's tokens are its planes' columns), then the products and a softmax over its tokens.
A program takes one block, for latency, except in large launches beside long paged ones (batch 64 at 32K tokens):
there it takes several with a running softmax (rest_blocks_per_program), since each program's queries, set-up and
partial cost about as much as a block's arithmetic, and what the launch costs a call beside the paged kernel is its
instructions (BENCHMARKS.md section 1, session 25).
A program writes a partial (output, max, sum) like a split program's, which decode_attention's merge combines with
them.

Measured on the H200 (BENCHMARKS.md section 1, session 12): the split kernel's own branch for these blocks, one
program per page-sized block walking its channels and token quarters one chunk at a time, took 8.5-11 us at batch 1
(a chain of dependent loads), as long as the Gluon kernel over all the pages of a 32K-token sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer, smid

from .layout import PagedKV, key_tile, key_tile_and_operand, value_tile
from .unpack import field_asm, unpacking

# int64 a program in a timeline's rows (bench tune --vary timeline), this kernel's and the Gluon paged kernel's
# times_ptr, so that one reader takes both: start, end, multiprocessor, then (the paged kernel's, with WAITS) key and
# value waits and cycles, and 2 unused
TIMES_ROW = tl.constexpr(8)

# Tokens of a block. 64 and 128 (one block a program then: fewer partials to write and merge at large batch, more
# latency a program) were slower or no faster at all six Qwen3-8B shapes (BENCHMARKS.md section 1, session 13).
REST_TOKENS = 32


def rest_warps(programs: int, sm_count: int) -> int:
    """Warps of a program in a launch of `programs`: 4 while there is at most one program a multiprocessor (batch 1
    of Qwen3-8B's kitty-pro: 72 programs, 3.8 against 4.2 us), else 2 (4 cost 2-4 us at batch 64, 1 is slower
    everywhere; BENCHMARKS.md section 1, sessions 12 and 13). Beside the paged kernel by PDL, one warp capped at 168
    registers (launch_rest's maxnreg, so that it fits beside the paged programs) measured faster for kitty-pro at
    batch 8 / 4K (15.2 against 16.9 us) and no faster or slower elsewhere (kitty 419.8 against 410.4 at 64 / 32K):
    not taken (session 24)."""
    return 4 if programs <= sm_count else 2


def rest_maxnreg(warps: int, blocks_per_program: int) -> int | None:
    """Register cap a thread of the remaining blocks' programs (None: the compiler's): 168 for 2-warp programs of 3
    blocks or more (kitty-pro from batch 32 at 16K and 32K), whose loop takes 251 at the compiler's choice (4
    programs a multiprocessor, each waiting for the registers of three ended paged programs) and 168 without spills
    (6 a multiprocessor). Measured beside the paged kernel by PDL on an H100 (`bench tune --vary rest-pdl`;
    BENCHMARKS.md section 1, session 37): kitty-pro at batch 64 / 32K 482.8 and 483.7 against 486.7 and 487.4 us
    in two replicates (2 warps at 96, 4 at the compiler's 168 or at 128 and 1 warp at 168 were slower); in a second
    run faster by 0.1-5.4 us at all 8 shapes of 3 to 5 blocks a program (kitty and kitty-pro, batches 32 and 64, 16K
    and 32K), slower by 0.9-2.5 at 3 of the 4 of 2 blocks (batch 16); at batch 32 a third run left it 0.4 us faster
    on average (7 of 8 pairs). One block a program compiles without the loop, under 168 registers."""
    return 168 if warps == 2 and blocks_per_program >= 3 else None


def rest_block_tokens(page_size: int) -> int:
    """Tokens of one block: REST_TOKENS, or a whole page where pages are shorter; at least 16 (the matrix products'
    smallest tile)."""
    return max(16, min(REST_TOKENS, triton.next_power_of_2(page_size)))


def rest_parts(kv: PagedKV, blocks_per_program: int = 1) -> int:
    """A sequence's programs here, each writing one partial: its blocks (rest_blocks of its buffers' capacity, an
    upper bound from sizes the host knows) blocks_per_program at a time."""
    return triton.cdiv(rest_blocks(kv.page_size, kv.sink, max(kv.k_fp.shape[2], kv.v_fp.shape[2])), blocks_per_program)


# Several blocks a program only beside a long paged launch: a program's chain of blocks then ends inside it
REST_LOOP_PAGES = 128


def rest_blocks_per_program(sequences: int, blocks: int, sm_count: int, pages: int) -> int:
    """Blocks a program takes in a launch over `sequences` (sequence, KV head) pairs of `blocks` blocks each, beside
    a paged launch over up to `pages` pages a sequence: one, unless the launch has more than 8 blocks a
    multiprocessor and the sequences at least REST_LOOP_PAGES pages (16K tokens of Qwen3-8B's kitty-pro); then
    about a quarter of its blocks a multiprocessor, at most a sequence's, shared evenly by a sequence's programs (9
    blocks at 8 a program would be programs of 8 and 1: 5 and 4 instead, the same programs with shorter chains).
    Measured on the H200 beside the paged kernel by PDL (kitty-pro, 9 blocks a sequence, `bench tune --vary
    rest-blocks`; BENCHMARKS.md section 1, session 28): at batch 64 / 32K, 2-9 a program 421.5-424.5 us against
    429.1 with one (and the default 5 410.4-414.2 against 417.3-419.0 in a later run); at 64 / 4K, where the paged
    launch takes 50 us, a program's chain of 8 blocks outlasts it (85.8 against 80.2 us); at batches 8 and 16 one
    is the fastest or within 1 %. One block a program compiles without the loop (BPP is a compile-time constant):
    the loop takes 254 registers a thread at 2 warps, against 119."""
    if sequences * blocks <= 8 * sm_count or pages < REST_LOOP_PAGES:
        return 1
    programs = triton.cdiv(blocks, min(blocks, sequences * blocks // (4 * sm_count)))
    return triton.cdiv(blocks, programs)


def rest_blocks(page_size: int, sink: int, capacity: int) -> int:
    """Blocks of a sequence whose full-precision buffers hold at most `capacity` tokens (sink included), with
    rest_block_tokens(page_size) tokens each: the sink's, and those of the slots after the paged ones.
    Those slots start at a slot boundary and span the longer side's buffer: with n_kpages >= n_vpages, the key pages
    past the paged slots and the key buffer hold as many tokens as the value buffer (and the other way round), so
    at most capacity - sink tokens, and only the blocks that those tokens can reach are launched: a last slot that
    the capacity only starts (a buffer's flush_spread - 1 waiting tokens) gets the blocks of its first tokens, not
    a page's (kitty-pro with a spread of 13: 10 blocks a sequence instead of 13)."""
    t = rest_block_tokens(page_size)
    tokens = capacity - sink
    return triton.cdiv(sink, t) + triton.cdiv(page_size, t) * (tokens // page_size) + triton.cdiv(tokens % page_size, t)


# _field's PTX (kernels/unpack.py), by the products' operand type
FIELD_BF16 = tl.constexpr(field_asm(torch.bfloat16))
FIELD_FP16 = tl.constexpr(field_asm(torch.float16))


# How the remaining blocks of a key page read its codes (launch_rest's `keys`; _rest_block's KEYS is the index):
# "elements", each one's bits by shifts, an AND and a conversion, then dequantized in float32; "codes", one 2-bit
# field of every byte by field_asm's PTX (7 instructions a word of 4 codes) as the product's operand, the page's
# scales on the queries (the paged kernels' algebra).
KEY_READS = ("elements", "codes")


def takes_fields(page_size: int) -> bool:
    """Whether a block of a key page is one token quarter or part of one (rest_block_tokens divides G/4), as
    KEY_READS' "codes" needs: its codes are then one 2-bit field of every byte."""
    return (page_size // 4) % rest_block_tokens(page_size) == 0


@triton.jit
def _field(x, shift, DOT: tl.constexpr, ASM: tl.constexpr):
    """A uint8 tile's 2-bit field at bits `shift` (a scalar, 0 to 6) as exact values of type DOT. ASM 1 / 2
    (compiled, bf16 / fp16 operands; unpack.unpacking): field_asm's PTX, 7 instructions a word of 4 bytes on sm_90;
    0 (the interpreter): shifts and a conversion. The PTX is declared impure, only so that Triton does not trace the
    products' operands back through it to the 8-bit load: it would then lay both operands out for 8-bit ones
    (kWidth 4), and build the other one, the queries times the scales, with a 64-bit shared-memory load and a move
    a register (about 70 more instructions a warp for a key page's block: kernels.sass_profile --kernel rest
    --rest-keys codes --blocks). (The fields as M + code, the fma left out, as the paged Triton kernel's bf16
    operands are, cost more: a block of 32 tokens must then sum its operand's 16 x 128 elements to take M back out,
    554 instructions a warp against 483 for the keys of a kitty-pro key page's block.)"""
    if ASM == 0:
        return ((x.to(tl.int32) >> shift) & 3).to(DOT)
    else:
        s = tl.full(x.shape, 0, tl.int32) + shift
        if ASM == 1:
            return tl.inline_asm_elementwise(asm=FIELD_BF16, constraints="=r,=r,r,r,r,r,r", args=[s, x],
                                             dtype=tl.bfloat16, is_pure=False, pack=4)
        else:
            return tl.inline_asm_elementwise(asm=FIELD_FP16, constraints="=r,=r,r,r,r,r,r", args=[s, x],
                                             dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _field_product(ptr, row, c, mask, operand, field, acc, G4: tl.constexpr, K: tl.constexpr, DOT: tl.constexpr,
                   PREC: tl.constexpr, ASM: tl.constexpr):
    """acc + operand (heads, K) . the codes of key plane `ptr` (K columns wide) at rows `row` (tokens), columns c,
    its field at bits `field` (_field): (heads, tokens). The plane's tile is read as stored (key_tile_and_operand:
    whole words, bytes 1 and 2 of each traded) and the operand's columns put in that order, a renaming of its
    32-bit registers, where key_tile's tile in column order cost two PRMT a word of codes (kernels.sass_profile
    --kernel rest --rest-keys codes --blocks: 483 instructions a warp instead of 521 for the keys of a kitty-pro key
    page's block)."""
    tile, operand = key_tile_and_operand(ptr, row, c, mask, tl.trans(operand), G4, K)
    return tl.dot(tl.trans(operand).to(DOT), tl.trans(_field(tile, field, DOT, ASM)), acc, input_precision=PREC)


@triton.jit
def _rest_block(j, q, q_dot, q_rows, hmask, kfp_ptr, vfp_ptr, klow_ptr, khigh_ptr, kch_ptr, kscale_ptr,
                kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr, ktab_ptr, vtab_ptr, b, h, kv_head, length, nkp,
                nvp, n_paged, sink_len, n_sink, qk_scale, CK, CV, KMP, VMP,
                H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, G: tl.constexpr, NB: tl.constexpr,
                V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, T: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_NB: tl.constexpr, KEYS: tl.constexpr,
                ASM: tl.constexpr):
    """Block j of a sequence's remaining tokens: its scores (BLOCK_M heads, T tokens; log2 units, -inf where a
    token does not exist) and values (T, BLOCK_D) in float32. Blocks 0 .. cdiv(sink, T) - 1 are the sink's; then
    each slot after the paged ones (n_paged = min(n_kpages, n_vpages)) gives cdiv(G, T) blocks of T consecutive
    tokens. Both the 16-bit rows and the dequantized codes are float32 tiles, rounded to DOT at the products: 16-bit
    rows loaded as DOT operands as they are took 20 KB of shared memory a program for the products' layout
    conversions instead of 12 (no fewer instructions), and with that version beside the paged kernel by PDL the
    H200 measured calls up to 7 us slower at batches 1 and 8 (kivi-k2v2 at 1 / 4K: 13.5 against 6.9 us, slower
    than without PDL; BENCHMARKS.md section 1, session 28)."""
    G4: tl.constexpr = G // 4
    D4: tl.constexpr = D // 4
    PIECES: tl.constexpr = (G + T - 1) // T             # blocks of a slot
    in_sink = j < n_sink
    u = tl.maximum(j - n_sink, 0)                       # the block's place among the slots' blocks
    slot = n_paged + u // PIECES
    t = tl.arange(0, T)
    tok = (u % PIECES) * T + t                          # the block's tokens within their slot (in a page: token
    quarter = tok // G4                                 # `tok` is row tok % G4 of the key planes at bits 2 * quarter,
    row = tok % G4                                      # and column tok of the value planes)
    # the block's tokens that exist: in the slot (pages that T does not divide) and in the sequence
    valid = tl.where(in_sink, j * T + t < sink_len, (tok < G) & (S + slot * G + tok < length))
    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    # keys (T, D): T tokens of key page `slot` (its low bits, dequantized; the boosted channels' high bits add
    # 4 * (q_c * scale_c) * high_c to the scores, `boost`), or full-precision rows. KEYS 1 (KEY_READS' "codes"; a
    # key page's block in one token quarter, takes_fields): the block's fields themselves are the product's operand,
    # exact (_field), with the page's scales on the queries: q . k_t = sum_d (q_d * scale_d) * code_dt + sum_d q_d *
    # zero_d (q: the queries in float32, times qk_scale), and each kind of block takes its own product: one after the
    # branches merged both kinds' keys in one layout, which cost the 16-bit rows' blocks more than the codes saved
    # (kernels.sass_profile --kernel rest --rest-keys codes; BENCHMARKS.md section 1, session 40).
    boost = tl.zeros((BLOCK_M, T), tl.float32)
    if (j >= n_sink) & (slot < nkp):
        kpage = tl.load(ktab_ptr + b * KMP + slot).to(tl.int64) * H + h
        shift = 2 * quarter[:, None]
        field = 2 * ((u % PIECES) * T // G4)                                     # KEYS 1: the quarter's bits
        low_ptr = klow_ptr + kpage * (G4 * D)
        scale = tl.load(kscale_ptr + kpage * D + d, mask=dmask, other=0.0).to(tl.float32)
        zero = tl.load(kzero_ptr + kpage * D + d, mask=dmask, other=0.0).to(tl.float32)
        if KEYS == 1:
            boost += tl.sum(q * zero[None, :], axis=1)[:, None]
        else:
            low = key_tile(low_ptr, row, d, (tok < G)[:, None] & dmask[None, :], G4, D)
            keys = ((low.to(tl.int32) >> shift) & 3).to(tl.float32) * scale[None, :] + zero[None, :]
        if NB > 0:
            r = tl.arange(0, BLOCK_NB)
            rmask = r < NB
            ch = tl.load(kch_ptr + kpage * NB + r, mask=rmask, other=0).to(tl.int32)
            ch_scale = tl.load(kscale_ptr + kpage * D + ch, mask=rmask, other=0.0).to(tl.float32)
            q_ch = tl.load(q_rows + ch[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
            high_ptr = khigh_ptr + kpage * (G4 * NB)
            high_mask = (tok < G)[:, None] & rmask[None, :]
            q_high = q_ch * qk_scale * (4.0 * ch_scale)[None, :]
            if KEYS == 1:
                boost = _field_product(high_ptr, row, r, high_mask, q_high, field, boost, G4, NB, DOT, PREC, ASM)
            else:
                high = ((key_tile(high_ptr, row, r, high_mask, G4, NB).to(tl.int32) >> shift) & 3).to(tl.float32)
                boost = tl.dot(q_high.to(DOT), tl.trans(high.to(DOT)), boost, input_precision=PREC)
        if KEYS == 1:
            scores = _field_product(low_ptr, row, d, (tok < G)[:, None] & dmask[None, :], q * scale[None, :], field,
                                    boost, G4, D, DOT, PREC, ASM)
    else:
        krow = tl.where(in_sink, j * T, S + (slot - nkp) * G + (u % PIECES) * T)
        keys = tl.load(kfp_ptr + (kv_head * CK + krow + t[:, None]) * D + d[None, :],
                       mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        if KEYS == 1:
            scores = tl.dot(q_dot, tl.trans(keys.to(DOT)), input_precision=PREC)
    if KEYS == 0:
        scores = tl.dot(q_dot, tl.trans(keys.to(DOT)), boost, input_precision=PREC)      # (heads, tokens), log2
    # values (T, D): the same tokens of value page `slot`, or full-precision rows
    if (j >= n_sink) & (slot < nvp):
        vpage = tl.load(vtab_ptr + b * VMP + slot).to(tl.int64) * H + h
        tmask = (tok < G)[:, None] & dmask[None, :]
        byte = (d % D4)[None, :]                                                # channel d's byte: d % D4
        shift = 2 * (d // D4)[None, :]                                          # ... at bits 2 * (d // D4)
        code = (value_tile(vlow_ptr + vpage * (D4 * G), byte, tok[:, None], tmask, G, D4, 0).to(tl.int32)
                >> shift) & 3
        if V_BITS == 4:
            code = code | (((value_tile(vhigh_ptr + vpage * (D4 * G), byte, tok[:, None], tmask, G, D4, 0)
                             .to(tl.int32) >> shift) & 3) << 2)
        scale = tl.load(vscale_ptr + vpage * G + tok, mask=tok < G, other=0.0).to(tl.float32)
        zero = tl.load(vzero_ptr + vpage * G + tok, mask=tok < G, other=0.0).to(tl.float32)
        values = code.to(tl.float32) * scale[:, None] + zero[:, None]
    else:
        vrow = tl.where(in_sink, j * T, S + (slot - nvp) * G + (u % PIECES) * T)
        values = tl.load(vfp_ptr + (kv_head * CV + vrow + t[:, None]) * D + d[None, :],
                         mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)

    return tl.where(valid[None, :], scores, float("-inf")), values


@triton.jit
def _block_exists(j, n_sink, sink_len, n_paged, length, S: tl.constexpr, G: tl.constexpr, T: tl.constexpr):
    """Whether block j (as _rest_block numbers them) holds a token of the sequence."""
    PIECES: tl.constexpr = (G + T - 1) // T
    u = tl.maximum(j - n_sink, 0)
    first = (u % PIECES) * T
    return tl.where(j < n_sink, j * T < sink_len, (first < G) & (S + (n_paged + u // PIECES) * G + first < length))


@triton.jit(do_not_specialize=["CK", "CV", "KMP", "VMP", "NPART", "FIRST_PART", "NBLK"])
def _rest_kernel(
        q_ptr, kfp_ptr, vfp_ptr,
        klow_ptr, khigh_ptr, kch_ptr, kscale_ptr, kzero_ptr,
        vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
        ktab_ptr, vtab_ptr, seqlen_ptr, nkp_ptr, nvp_ptr,
        po_ptr, pm_ptr, pl_ptr,
        qk_scale, CK, CV, KMP, VMP, NPART, FIRST_PART, NBLK,
        BPP: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
        NB: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, T: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_NB: tl.constexpr, PDL: tl.constexpr = False,
        KEYS: tl.constexpr = 0, ASM: tl.constexpr = 0, times_ptr=None):
    """Program (b, h, p): blocks p * BPP .. p * BPP + BPP - 1 (of the NBLK launched a sequence; _rest_block numbers
    them) of sequence b's remaining tokens for KV head h, one after the other with a running softmax, written as
    part FIRST_PART + p. Blocks without a token of the sequence are skipped (a program with none writes an empty
    partial, max -inf, which the merge weighs 0). Why several blocks a program: where the launch has many programs,
    each one's queries, set-up and partial cost about as much as a block's arithmetic; one program a block keeps the
    latency low where the launch is small or the paged launch short (rest_blocks_per_program). PDL: launched beside
    the paged slots' kernel (decode_launches' pdl): the merge after it may start at once, and the grid's last
    program waits for the paged grid before it ends, so that this grid's end (what the merge waits for) means both
    are done. Only one program waits: while every program waited, the programs that had started held their
    multiprocessors' registers until the paged grid ended, and the rest could not start before then (kivi-k2v2 at
    batch 64 / 4K: 70.0 us a call then, 65.0 now; BENCHMARKS.md section 1, session 25). times_ptr (a measurement,
    `bench tune --vary timeline`): each program writes when it started and ended (%globaltimer, ns; its end before
    the last program's wait) and its multiprocessor, TIMES_ROW int64 a program in grid order, as the Gluon kernel's
    programs do."""
    if times_ptr is not None:
        started = globaltimer()
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    length = tl.load(seqlen_ptr + b)
    nkp = tl.load(nkp_ptr + b)
    nvp = tl.load(nvp_ptr + b)
    n_paged = tl.minimum(nkp, nvp)
    sink_len = tl.minimum(length, S)
    n_sink = tl.cdiv(sink_len, T)
    kv_head = (b * H + h).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    heads = tl.arange(0, BLOCK_M)
    hmask = heads < GROUP
    rows = (kv_head * GROUP + heads).to(tl.int64)
    q_rows = q_ptr + rows[:, None] * D
    q = tl.load(q_rows + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * qk_scale
    q_dot = q.to(DOT)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for i in range(BPP):
        j = p * BPP + i
        if (j < NBLK) & _block_exists(j, n_sink, sink_len, n_paged, length, S, G, T):
            scores, values = _rest_block(j, q, q_dot, q_rows, hmask, kfp_ptr, vfp_ptr, klow_ptr, khigh_ptr,
                                         kch_ptr, kscale_ptr, kzero_ptr, vlow_ptr, vhigh_ptr, vscale_ptr, vzero_ptr,
                                         ktab_ptr, vtab_ptr, b, h, kv_head, length, nkp, nvp, n_paged, sink_len,
                                         n_sink, qk_scale, CK, CV, KMP, VMP, H, D, S, G, NB, V_BITS, DOT, PREC, T,
                                         BLOCK_M, BLOCK_D, BLOCK_NB, KEYS, ASM)
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)                # rows with no score yet stay empty
            alpha = tl.math.exp2(m_i - m_use)
            prob = tl.math.exp2(scores - m_use[:, None])                       # 0 where masked
            l_i = l_i * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(DOT), values.to(DOT), input_precision=PREC)
            m_i = m_new

    idx = rows * NPART + FIRST_PART + p
    tl.store(pm_ptr + idx, m_i, mask=hmask)
    tl.store(pl_ptr + idx, l_i, mask=hmask)
    tl.store(po_ptr + idx[:, None] * D + d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
    if times_ptr is not None:
        row = times_ptr + ((b * H + h) * tl.num_programs(2) + p).to(tl.int64) * TIMES_ROW
        tl.store(row, started)
        tl.store(row + 1, globaltimer())
        tl.store(row + 2, smid().to(tl.int64))
    if PDL:
        if (b == tl.num_programs(0) - 1) & (h == tl.num_programs(1) - 1) & (p == tl.num_programs(2) - 1):
            gdc_wait()


def rest_kernel_arguments(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, first_part: int, dot,
                          prec: str, pdl: bool = False, blocks_per_program: int = 1,
                          keys: str = "elements") -> tuple[tuple, dict]:
    """Run-time arguments and compile-time constants of _rest_kernel: parts (output, max, sum) first_part ..
    first_part + rest_parts(kv, blocks_per_program) - 1 of each row (q (B, HQ, D); qk_scale = sm_scale * log2(e);
    dot / prec: the products' operand type and input precision, decode_attention's; keys: how a key page's blocks
    read its codes, one of KEY_READS, "elements" where its blocks are not in one token quarter, takes_fields).
    Also used to compile the kernel for a profile (kernels.sass_profile)."""
    hq, d = q.shape[1:]
    h = kv.k_fp.shape[1]
    args = (q, kv.k_fp, kv.v_fp, kv.k_low, kv.k_high, kv.k_ch, kv.k_scale, kv.k_zero, kv.v_low, kv.v_high,
            kv.v_scale, kv.v_zero, kv.k_table, kv.v_table, kv.seq_len, kv.n_kpages, kv.n_vpages, *parts, qk_scale,
            kv.k_fp.shape[2], kv.v_fp.shape[2], kv.k_table.shape[1], kv.v_table.shape[1], parts[1].shape[2],
            first_part, rest_parts(kv))
    constants = dict(H=h, GROUP=hq // h, D=d, S=kv.sink, G=kv.page_size, NB=kv.n_boost, V_BITS=kv.v_bits, DOT=dot,
                     PREC=prec, T=rest_block_tokens(kv.page_size), BLOCK_M=max(16, triton.next_power_of_2(hq // h)),
                     BLOCK_D=triton.next_power_of_2(d), BLOCK_NB=max(16, triton.next_power_of_2(kv.n_boost)),
                     BPP=blocks_per_program, PDL=pdl,
                     KEYS=KEY_READS.index(keys) if takes_fields(kv.page_size) else 0, ASM=unpacking(dot))
    return args, constants


def launch_rest(q: torch.Tensor, kv: PagedKV, qk_scale: float, parts, first_part: int, dot, prec: str,
                num_warps: int, pdl: bool = False, maxnreg: int | None = None, blocks_per_program: int = 1,
                times: torch.Tensor | None = None, keys: str = "elements") -> None:
    """Run _rest_kernel (see rest_kernel_arguments) for every sequence and KV head, num_warps warps a program,
    blocks_per_program blocks each; pdl: by programmatic dependent launch, beside the paged slots' kernel launched
    just before; maxnreg: a register cap per thread (a one-warp program of at most 176 fits beside 11 paged programs
    of 168 registers, which leave one scheduler 5,632 registers: bench tune --vary rest-pdl); times (a measurement,
    int64, TIMES_ROW a program, at least as many rows as programs): the kernel's times_ptr; keys:
    rest_kernel_arguments'."""
    args, constants = rest_kernel_arguments(q, kv, qk_scale, parts, first_part, dot, prec, pdl, blocks_per_program,
                                            keys)
    grid = (q.shape[0], kv.k_fp.shape[1], rest_parts(kv, blocks_per_program))
    _rest_kernel[grid](*args, **constants, times_ptr=times, num_warps=num_warps,
                       **({"launch_pdl": True} if pdl else {}),
                       **({"maxnreg": maxnreg} if maxnreg else {}))
