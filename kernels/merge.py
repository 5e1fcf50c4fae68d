"""The merge of decode attention's partials, row by row: every (sequence, query head) row's parts (output, max, sum),
written by the paged slots' programs and the remaining blocks' programs, combined with log-sum-exp weights.

Two ways to run it (decode_attention's `merge`, MERGES):
- "launch": a launch of its own after the other two (decode_attention.merge_splits), one or more programs a row;
- "last": by whichever program of a (sequence, KV head) stores its partial last, with no launch of its own. Each
  program, once its partial is stored, counts itself in the pair's counter (a release add, after a barrier, so
  that every thread's stores come before it); the one whose add completes the count (an acquire too) merges the
  pair's rows, reading the partials from L2, and sets the counter back to zero, so that a workspace's counters are
  zero between calls and a CUDA graph replays them. Nobody waits: session 38's fused merge (commit bd2acc7) had the
  last remaining program wait for its pair's paged programs, holding its multiprocessor's slot, and was no faster
  on an H100 (BENCHMARKS.md section 1). The Triton kernels merge here (merge_if_last); the Gluon paged kernel has
  its own copy of the same steps (decode_gluon._merge_if_last).
Why "last": at batch 64 / 32K a call ends with the merge launch's chain after the paged programs' last end (the
remaining grid's completion, the merge's wait, its reads, its completion: a call adds 16.4 us to its paged launch
on the H200 and the paged span grows by 8.2 of them, session 42); merged by the last program, the rows merge
inside the paged launch's ragged end.
"""
from __future__ import annotations

import triton
import triton.language as tl

MERGES = ("launch", "last")
# The "launch" merge reads every part of every row once, MERGE_TILE floats (parts x channels) per step; "last"
# reads a row's parts in steps of at most MERGE_TILE // head_dim parts (last_merge_parts)
MERGE_TILE = 2048


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


@triton.jit
def merge_if_last(count_ptr, pair, po_ptr, pm_ptr, pl_ptr, out_ptr, NPART, GROUP: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """A program's partial of (sequence, KV head) `pair` is stored: one more in the pair's count (count_ptr: int32,
    one a pair); the program whose add makes it NPART merges the pair's GROUP rows (merged_row, BLOCK_S parts a
    step) and sets the count back to zero."""
    tl.debug_barrier()                  # every thread's stores come before the count (the release is cumulative)
    if tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu") == NPART - 1:
        tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")
        d = tl.arange(0, BLOCK_D)
        for r in tl.static_range(GROUP):
            merged_row(po_ptr, pm_ptr, pl_ptr, out_ptr, pair.to(tl.int64) * GROUP + r, d, NPART, D, BLOCK_S, ".cg")


def last_merge_parts(num_parts: int, d: int) -> int:
    """BLOCK_S of the "last" merge (merge_if_last, decode_gluon._merge_if_last): all of a row's parts in one step
    where they fit MERGE_TILE floats with the whole row's channels, else as many as do."""
    return max(1, min(triton.next_power_of_2(num_parts), MERGE_TILE // triton.next_power_of_2(d)))
