"""Fused page-boundary kernels: one launch per kind turns each due sequence's full buffer into a page, in place.

At a page boundary a KittyLayer with flush="fused" gives, for each due sequence i, its batch row rows[i], the page
id ids[i] its pool allocated and the page-table column cols[i] (device tensors from one copy). One program per
(due sequence, KV head) then
  1. reads the oldest G tokens of the full-precision buffer straight from k_fp / v_fp (no gathered copy);
  2. keys: picks the top-NB channels by magnitude (mean |k| over the page, float32, as quantize.choose_boost) and
     writes the page at its id: planes, scale / zero, channels, and the magnitudes when recorded; values: planes
     and per-token scale / zero (the recipe and layout of quantize.py, through its helpers);
  3. moves what stays full precision down by G: keys the `move` tokens that waited for their turn, values the
     local window and waiters (after a barrier: the page has been read by then);
  4. head 0 records the page: table[row, col] = page id, counts[row] += 1 (rows are distinct in one flush).

No separate reference: the result is that of choose_boost + quantize_*_ref + a pool write + a table append + the
shift (the torch path in backend/cache.py). Planes, scale and zero equal it bit for bit; magnitudes up to float32
summation order, so the channels too except on near-ties (tests/test_flush.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import _quantize_key_page, _quantize_value_page


@triton.jit
def _page_source(fp_ptr, rows_ptr, ids_ptr, H, CAP, SINK: tl.constexpr, D: tl.constexpr):
    """This program's batch row, page id, (page, head) index into the pool, and its buffer: token SINK of its row and
    head in the (B, H, CAP, D) full-precision tensor."""
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + tl.program_id(0))
    page = tl.load(ids_ptr + tl.program_id(0))
    return row, page, page * H + h, fp_ptr + ((row * H + h) * CAP + SINK) * D


@triton.jit
def _magnitudes(buf, G: tl.constexpr, D: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D: tl.constexpr):
    """Mean |k| over the page's G tokens per channel (BLOCK_D,) float32, read in token quarters."""
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    d = tl.arange(0, BLOCK_D)
    mask = (j < G4)[:, None] & (d < D)[None, :]
    src = buf + j[:, None] * D + d[None, :]
    total = tl.sum(tl.abs(tl.load(src, mask=mask, other=0.0).to(tl.float32)), axis=0)
    for i in tl.static_range(1, 4):
        total += tl.sum(tl.abs(tl.load(src + i * G4 * D, mask=mask, other=0.0).to(tl.float32)), axis=0)
    return tl.math.div_rn(total, G * 1.0)


@triton.jit
def _top_channels(magnitude, NB: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_NB: tl.constexpr):
    """The NB loudest channels as quantize_key_page takes them: ascending ids (BLOCK_NB,) padded with BLOCK_D, and
    their mask (BLOCK_D,). By rank, not by sorting: a channel is boosted when fewer than NB channels are louder
    (equal magnitudes: the lower id counts as louder)."""
    d = tl.arange(0, BLOCK_D)
    m = tl.where(d < D, magnitude, float("-inf"))                   # padding channels rank last
    mine, other = m[:, None], m[None, :]
    louder = (other > mine) | ((other == mine) & (d[None, :] < d[:, None]))
    boosted = (tl.sum(louder.to(tl.int32), axis=1) < NB) & (d < D)
    # the r-th boosted channel in ascending order is the one with r boosted channels below it
    below = tl.sum((boosted[None, :] & (d[None, :] < d[:, None])).to(tl.int32), axis=1)
    r = tl.arange(0, BLOCK_NB)
    hit = boosted[None, :] & (below[None, :] == r[:, None])
    ch = tl.sum(tl.where(hit, d[None, :], 0), axis=1)
    return tl.where(r < NB, ch, BLOCK_D), boosted


@triton.jit
def _shift_down(buf, G: tl.constexpr, MOVE: tl.constexpr, D: tl.constexpr, BLOCK_G4: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Move the MOVE tokens that follow the page (the first G tokens at buf, token stride D) to the buffer's start,
    G/4 tokens at a time in ascending order with a barrier after each chunk: a chunk overwrites only tokens already
    read (the page's, or an earlier chunk's), never one that it or a later chunk reads."""
    G4: tl.constexpr = G // 4
    j = tl.arange(0, BLOCK_G4)
    d = tl.arange(0, BLOCK_D)
    for start in range(0, MOVE, G4):
        t = start + j
        mask = ((j < G4) & (t < MOVE))[:, None] & (d < D)[None, :]
        x = tl.load(buf + (G + t)[:, None] * D + d[None, :], mask=mask)
        tl.store(buf + t[:, None] * D + d[None, :], x, mask=mask)
        tl.debug_barrier()


@triton.jit
def _record_page(table_ptr, counts_ptr, cols_ptr, row, page, TABLE_STRIDE):
    """Head 0's program enters the page in its sequence's table and counts it (no other program reads either)."""
    if tl.program_id(1) == 0:
        col = tl.load(cols_ptr + tl.program_id(0))
        tl.store(table_ptr + row * TABLE_STRIDE + col, page.to(table_ptr.dtype.element_ty))
        tl.store(counts_ptr + row, tl.load(counts_ptr + row) + 1)


@triton.jit
def _flush_keys_kernel(fp_ptr, rows_ptr, ids_ptr, cols_ptr, low_ptr, high_ptr, ch_ptr, scale_ptr, zero_ptr, mag_ptr,
                       table_ptr, counts_ptr, H, CAP, TABLE_STRIDE,
                       SINK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, MOVE: tl.constexpr,
                       RECORD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_NB: tl.constexpr):
    row, page, out, buf = _page_source(fp_ptr, rows_ptr, ids_ptr, H, CAP, SINK, D)
    magnitude = _magnitudes(buf, G, D, BLOCK_G4, BLOCK_D)
    ch, boosted = _top_channels(magnitude, NB, D, BLOCK_D, BLOCK_NB)
    d = tl.arange(0, BLOCK_D)
    if RECORD:
        tl.store(mag_ptr + out * D + d, magnitude.to(mag_ptr.dtype.element_ty), mask=d < D)
    if NB > 0:
        r = tl.arange(0, BLOCK_NB)
        tl.store(ch_ptr + out * NB + r, ch.to(tl.uint8), mask=r < NB)
    _quantize_key_page(buf, ch, boosted, low_ptr + out * (G // 4) * D, high_ptr + out * (G // 4) * NB,
                       scale_ptr + out * D, zero_ptr + out * D, G, D, NB, BLOCK_D, BLOCK_G4, BLOCK_NB)
    tl.debug_barrier()                                  # every thread has read the page before the shift writes it
    _shift_down(buf, G, MOVE, D, BLOCK_G4, BLOCK_D)
    _record_page(table_ptr, counts_ptr, cols_ptr, row, page, TABLE_STRIDE)


@triton.jit
def _flush_values_kernel(fp_ptr, rows_ptr, ids_ptr, cols_ptr, low_ptr, high_ptr, scale_ptr, zero_ptr,
                         table_ptr, counts_ptr, H, CAP, TABLE_STRIDE,
                         SINK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, MOVE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D4: tl.constexpr, BLOCK_G4: tl.constexpr, BLOCK_D: tl.constexpr):
    row, page, out, buf = _page_source(fp_ptr, rows_ptr, ids_ptr, H, CAP, SINK, D)
    plane = out * (D // 4) * G
    _quantize_value_page(buf, low_ptr + plane, high_ptr + plane, scale_ptr + out * G, zero_ptr + out * G,
                         G, D, BITS, BLOCK_G, BLOCK_D4)
    tl.debug_barrier()                                  # every thread has read the page before the shift writes it
    _shift_down(buf, G, MOVE, D, BLOCK_G4, BLOCK_D)
    _record_page(table_ptr, counts_ptr, cols_ptr, row, page, TABLE_STRIDE)


def _launch_shape(fp: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, page_size: int):
    """Grid, shared scalar arguments and block sizes of a flush over buffer `fp` (B, H, CAP, D)."""
    if not fp.is_contiguous() or not table.is_contiguous():
        raise ValueError("the fused flush needs contiguous buffers and page tables")
    _, heads, cap, dim = fp.shape
    blocks = dict(BLOCK_D=triton.next_power_of_2(dim), BLOCK_G4=triton.next_power_of_2(page_size // 4))
    return (rows.shape[0], heads), (heads, cap, table.stride(0)), blocks


def flush_key_pages(k_fp: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor,
                    pool: dict[str, torch.Tensor], table: torch.Tensor, counts: torch.Tensor, sink: int, page_size: int,
                    n_boost: int, move: int, record_magnitudes: bool) -> None:
    """Key pages for batch rows `rows` (distinct) from k_fp (B, H, CAP, D): tokens [sink, sink + G) of each row become
    pool page ids[i] (pool: the key page fields of layout.py, and "magnitude"), table[rows[i], cols[i]] = ids[i],
    counts[rows[i]] += 1, and the `move` tokens after the page move down by G. One launch."""
    grid, scalars, blocks = _launch_shape(k_fp, rows, table, page_size)
    _flush_keys_kernel[grid](k_fp, rows, ids, cols, *(pool[name] for name in ("low", "high", "ch", "scale", "zero")),
                             pool["magnitude"], table, counts, *scalars, SINK=sink, G=page_size, D=k_fp.shape[3],
                             NB=n_boost, MOVE=move, RECORD=record_magnitudes,
                             BLOCK_NB=triton.next_power_of_2(max(n_boost, 1)), **blocks, num_warps=4)


def flush_value_pages(v_fp: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor,
                      pool: dict[str, torch.Tensor], table: torch.Tensor, counts: torch.Tensor, sink: int,
                      page_size: int, bits: int, move: int) -> None:
    """Value pages, as flush_key_pages (pool: the value page fields of layout.py); `move`: the local window and the
    tokens that waited. One launch."""
    grid, scalars, blocks = _launch_shape(v_fp, rows, table, page_size)
    _flush_values_kernel[grid](v_fp, rows, ids, cols, *(pool[name] for name in ("low", "high", "scale", "zero")),
                               table, counts, *scalars, SINK=sink, G=page_size, D=v_fp.shape[3], BITS=bits, MOVE=move,
                               BLOCK_G=triton.next_power_of_2(page_size),
                               BLOCK_D4=triton.next_power_of_2(v_fp.shape[3] // 4), **blocks, num_warps=4)
