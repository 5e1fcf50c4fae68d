"""The merge of decode attention's partials: every (sequence, query head) row's parts (output, max, sum), written by
the paged slots' programs and the remaining blocks' programs, combined with log-sum-exp weights.

Two ways to run it (decode_attention.decode_launches' merge):
- "launch": a launch of its own after the other two (merge_splits), one or more programs a row;
- "fused": by the last of the remaining blocks' programs of each (sequence, KV head), with no launch of its own.
  Each paged program counts itself in the pair's counter once its partial is stored (`arrive`); each remaining
  program does the same in a second counter (`merge_if_last`), and the one that makes it complete waits for the
  paged count, merges the pair's rows and sets both counters back to zero, so that a workspace's counters are zero
  between calls (and a CUDA graph replays them). The wait cannot hang: the remaining blocks' launch follows the paged
  launch, either in stream order or by programmatic dependent launch, whose programs start once every paged program
  has started (they trigger it at entry), so the paged programs it waits for are resident or done.
Why fused: a call's last microseconds at batch 64 / 32K are the merge launch's (BENCHMARKS.md section 1, session 36:
9.5 us of a 486 us call outside both launches' programs, the merge 3.9 us alone); fused, the rows merge as their
last programs end, inside the paged launch's ragged end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

MERGES = ("launch", "fused")


@triton.jit
def merged_row(po_ptr, pm_ptr, pl_ptr, out_ptr, row, d, NPART, D: tl.constexpr, BLOCK_S: tl.constexpr,
               CACHE: tl.constexpr):
    """out[row, d] for channels d (masked at D): the partials of row's NPART parts merged in one pass (a running
    maximum rescales what is summed so far), BLOCK_S parts a step. CACHE: the partials' loads' cache modifier
    (".cg" where other multiprocessors wrote them during this launch: read from L2)."""
    dmask = d < D
    m_run = float("-inf")
    den = 0.0
    num = tl.zeros(d.shape, tl.float32)
    for first in range(0, NPART, BLOCK_S):
        sp = first + tl.arange(0, BLOCK_S)
        smask = sp < NPART
        m = tl.load(pm_ptr + row * NPART + sp, mask=smask, other=float("-inf"), cache_modifier=CACHE)
        lsum = tl.load(pl_ptr + row * NPART + sp, mask=smask, other=0.0, cache_modifier=CACHE)
        o = tl.load(po_ptr + (row * NPART + sp[:, None]) * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                    other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.where(m_run > float("-inf"), tl.math.exp2(m_run - m_new), 0.0)
        w = tl.where(m > float("-inf"), tl.math.exp2(m - m_new), 0.0)      # empty parts (m = -inf) weigh 0
        den = den * alpha + tl.sum(lsum * w, 0)
        num = num * alpha + tl.sum(o * w[:, None], 0)
        m_run = m_new
    tl.store(out_ptr + row * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["NPART"])
def _merge_splits_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, NPART, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_DC: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, query head) row and BLOCK_DC of its channels (merged_row). PDL: launched while the kernels
    that write the partials still run (decode_launches' pdl): it waits for them first."""
    if PDL:
        gdc_wait()
    merged_row(po_ptr, pm_ptr, pl_ptr, out_ptr, tl.program_id(0).to(tl.int64),
               tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC), NPART, D, BLOCK_S, "")


@triton.jit
def arrive(count_ptr, pair):
    """A paged program's partial of (sequence, KV head) `pair` is stored: one more in the pair's paged count
    (count_ptr: int32 (pairs, 2), the paged and the remaining programs' counts)."""
    tl.debug_barrier()                  # every thread's stores come before the count (the release is cumulative)
    tl.atomic_add(count_ptr + 2 * pair, 1, sem="release", scope="gpu")


@triton.jit
def merge_if_last(count_ptr, pair, po_ptr, pm_ptr, pl_ptr, out_ptr, first_row, d, NSPLIT, NREST, NPART,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """A remaining program's partial of `pair` is stored: one more in the pair's remaining count; the program that
    makes it NREST waits until the pair's NSPLIT paged programs have arrived, merges the pair's GROUP rows from
    first_row (channels d) and sets both counts back to zero."""
    tl.debug_barrier()
    count = count_ptr + 2 * pair
    if tl.atomic_add(count + 1, 1, sem="acq_rel", scope="gpu") == NREST - 1:
        paged = tl.atomic_add(count, 0, sem="acquire", scope="gpu")
        while paged < NSPLIT:
            paged = tl.atomic_add(count, 0, sem="acquire", scope="gpu")
        tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count + 1, 0, sem="relaxed", scope="gpu")
        for r in tl.static_range(GROUP):
            merged_row(po_ptr, pm_ptr, pl_ptr, out_ptr, first_row + r, d, NPART, D, BLOCK_S, ".cg")


# The merge reads every part of every row once, MERGE_TILE floats (BLOCK_S parts x BLOCK_DC channels) per step. A
# row's channels are split over programs while there are too few rows to fill the GPU: a batch of one (32 rows for
# Qwen3-8B) takes 4 programs of 64 parts x 32 channels per row (21.6 instead of 28.0 us at batch 1 / 32K, where one
# one-warp program per row looped 16 parts at a time; BENCHMARKS.md section 1); from 4 rows per multiprocessor on
# (Qwen3-8B: batch 17 and up) each row is one program reading 16 parts x 128 channels a step, the earlier merge's
# tile.
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


def fused_merge_parts(num_parts: int, d: int) -> int:
    """BLOCK_S of the fused merge (merge_if_last): all of a row's parts in one step where they fit MERGE_TILE floats
    with the whole row's channels, else as many as do."""
    return max(1, min(triton.next_power_of_2(num_parts), MERGE_TILE // triton.next_power_of_2(d)))


def merge_splits(part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor,
                 sm_count: int, pdl: bool = False) -> torch.Tensor:
    """out (B, HQ, D) = sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M) l_p over the parts p of each row (M: the rows'
    largest m; parts with m = -inf weigh nothing): the split programs' partials (B, HQ, P, D), (B, HQ, P) x 2.
    sm_count: the multiprocessors the merge spreads over; pdl: launched by programmatic dependent launch beside the
    kernel before it (decode_launches' pdl)."""
    bsz, hq, num_parts, d = part_o.shape
    block_s, block_dc = merge_blocks(bsz * hq, d, sm_count, num_parts)
    _merge_splits_kernel[(bsz * hq, triton.cdiv(d, block_dc))](part_o, part_m, part_l, out, num_parts, D=d,
                                                               BLOCK_S=block_s, BLOCK_DC=block_dc,
                                                               num_warps=MERGE_WARPS,
                                                               **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out
