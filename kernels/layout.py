"""Page layout and bit accounting, shared by the kernels, their references and the cache.

Key page (one per G tokens, all KV heads of one sequence), dense-sparse decomposition of the paper (Sec. 4.1):
    low   (H, D/C, G/4, C)    uint8  low 2 bits of every channel: byte [c, j, i] holds channel c*C + i of tokens
                                     j + q*G/4 at bits 2q (q = 0..3, "token quarters"); C = key_chunk(D): 32
    high  (H, NB/C', G/4, C') uint8  the same for the high 2 bits of the NB boosted channels only (NB = D for
                                     4-bit keys, 0 for KIVI-K2), C' = key_chunk(NB); key_chunk is 32 where 32
                                     divides the plane's width, else the whole width (16 boosted channels: 16)
    ch    (H, NB)             uint8  the boosted channels, ascending: column r of `high` is channel ch[r]
    scale (H, D) fp16, zero (H, D) fp16: asymmetric min-max per channel; k = (low | high << 2) * scale + zero
Value page (per-token quantization, KIVI style):
    low   (H, 4, D/4, G/4)    uint8  low 2 bits of every channel: byte [q, c, t] holds token q*G/4 + t's channels
                                     c + i*D/4 at bits 2i ("channel quarters")
    high  (H, 4, D/4, G/4)    uint8  high 2 bits, only for 4-bit values (an empty plane, (H, 0, D/4, G/4), for 2-bit)
    scale (H, G) fp16, zero (H, G) fp16: per token

Why this order: the decode kernel contracts keys over channels and values over tokens, so each plane keeps its
contracted dimension contiguous (a matrix-unit operand is then one 32-bit word of 4 consecutive elements, read
straight from shared memory with ldmatrix), and the four 2-bit fields of a byte are four contiguous quarters of
the other dimension (each quarter is a dense operand of its own: no register re-layout after unpacking).
Each plane is stored chunk by chunk (a key plane's rows of C channels, a value plane's token quarters), the order
in which the Gluon kernel computes it and keeps it in shared memory: so a page's plane is one contiguous run that
one TMA box of whole 128-byte rows copies as it is. TMA boxes of the 32-byte rows of one chunk, which the
row-major planes before needed, capped the kernel's copies at 3,954 GB/s at batch 64 / 32K, where boxes of
128-byte rows reached 4,326 (H200, 2026-12-03, `python -m backend.bench tune --vary loads`, BENCHMARKS.md section
1, session 22). Within every 4 bytes of a stored row, bytes 1 and 2 trade places (column 4a + b is stored at
4a + SWAP[b]): the Gluon kernel turns a word of code bytes into fp16 operand pairs from its bytes 0 and 2 and its
bytes 1 and 3, which are then two pairs of consecutive columns, as the matrix unit's other operand holds them (in
the natural order, 32 byte permutes a kitty-pro page reordered that operand instead: BENCHMARKS.md section 1,
session 26). key_rows / value_rows give the planes row by row and in order, as the references read them;
key_offsets / value_offsets address them for the Triton kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SCALE_DTYPE = torch.float16
FP_DTYPE = torch.float16        # full-precision parts (sink, buffers, value window) are stored at 16 bits


def key_page_bytes(heads: int, head_dim: int, page_size: int, boosted: int) -> int:
    """Bytes of one key page (all heads): both bit planes, the boosted-channel list and FP16 scale/zero."""
    planes = head_dim * page_size // 4 + boosted * page_size // 4
    return heads * (planes + boosted + 2 * 2 * head_dim)


def value_page_bytes(heads: int, head_dim: int, page_size: int, bits: int) -> int:
    """Bytes of one value page (all heads): one bit plane per 2 bits and FP16 scale/zero per token."""
    planes = (bits // 2) * page_size * head_dim // 4
    return heads * (planes + 2 * 2 * page_size)


KEY_CHUNK = 32                  # channels of a key plane's chunk (the Gluon kernel's KC)


@triton.constexpr_function
def key_chunk(columns: int) -> int:
    """Columns of a chunk of a key plane `columns` wide: KEY_CHUNK where chunks of it tile the plane, else the
    whole plane (16 boosted channels, or 48 of head_dim 192)."""
    return KEY_CHUNK if columns % KEY_CHUNK == 0 else columns


def key_plane_shape(heads: int, page_size: int, columns: int) -> tuple[int, int, int, int]:
    """A key page's plane of `columns` channels (D, or NB boosted), all heads: (H, chunks, G/4, chunk)."""
    c = key_chunk(columns)
    return heads, columns // c, page_size // 4, c


def value_plane_shape(heads: int, head_dim: int, page_size: int, present: bool = True) -> tuple[int, int, int, int]:
    """A value page's plane, all heads: (H, 4 token quarters, D/4, G/4); no quarters for a plane the page lacks."""
    return heads, 4 if present else 0, head_dim // 4, page_size // 4


SWAP = (0, 2, 1, 3)             # where byte b of every 4 of a stored row lies (its own inverse)


def swapped(x: torch.Tensor) -> torch.Tensor:
    """x's last dimension with bytes 1 and 2 of every whole 4 traded (a last partial 4 left as it is): stored order
    <-> column order, both ways."""
    n = x.shape[-1]
    order = torch.arange(n, device=x.device)
    whole = n - n % 4
    order[:whole] = order[:whole].reshape(-1, 4)[:, list(SWAP)].flatten()
    return x[..., order]


def key_rows(plane: torch.Tensor) -> torch.Tensor:
    """(..., chunks, G/4, C) stored key plane -> (..., G/4, chunks * C) bytes, row j holding its channels in order."""
    *lead, n, r, c = plane.shape
    return swapped(plane).transpose(-3, -2).reshape(*lead, r, n * c)


def key_chunks(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of key_rows: (..., G/4, K) -> the stored (..., K/C, G/4, C), C = key_chunk(K)."""
    *lead, r, k = rows.shape
    c = key_chunk(k)
    return swapped(rows.reshape(*lead, r, k // c, c).transpose(-3, -2)).contiguous()


def value_rows(plane: torch.Tensor) -> torch.Tensor:
    """(..., 4, D/4, G/4) stored value plane -> (..., D/4, G) bytes, tokens in order (a plane without quarters
    gives (..., D/4, 0))."""
    *lead, n, c, t = plane.shape
    return swapped(plane).permute(*range(len(lead)), -2, -3, -1).reshape(*lead, c, n * t)


def value_chunks(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of value_rows: (..., D/4, G) -> the stored (..., 4, D/4, G/4)."""
    *lead, c, g = rows.shape
    return swapped(rows.reshape(*lead, c, 4, g // 4).transpose(-3, -2)).contiguous()


@triton.jit
def swap_column(i, N: tl.constexpr):
    """Where column i of a row of N lies in its stored row, and which column a stored row holds at i (SWAP: bits 0
    and 1 of i traded, in the row's whole 4; a last partial 4 is stored in order)."""
    s = (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)
    if N % 4 != 0:
        s = tl.where(i < N - N % 4, s, i)
    return s


@triton.jit
def key_offsets(j, d, G4: tl.constexpr, K: tl.constexpr, AS_STORED: tl.constexpr = False):
    """Offsets in a key plane K columns wide (layout.py: chunk by chunk) of rows j (a column vector's worth) and
    columns d: a (rows, columns) tile. AS_STORED: its columns in stored order instead (column d of the tile is then
    column swap_column(d) of the plane: whole words, which the compiler can read as vectors; key_tile)."""
    C: tl.constexpr = key_chunk(K)
    column = d % C
    if not AS_STORED:
        column = swap_column(column, C)
    return (d // C)[None, :] * (G4 * C) + j[:, None] * C + column[None, :]


@triton.jit
def value_offsets(c, t, G: tl.constexpr, D4: tl.constexpr, AS_STORED: tl.constexpr = False):
    """Offsets in a value plane (layout.py: token quarter by token quarter) of channel bytes c and tokens t
    (broadcast against each other). AS_STORED: the tokens in stored order instead (as key_offsets')."""
    G4: tl.constexpr = G // 4
    column = t % G4
    if not AS_STORED:
        column = swap_column(column, G4)
    return (t // G4) * (D4 * G4) + c * G4 + column


@triton.jit
def in_order(tile, AXIS: tl.constexpr):
    """A 2-D tile with dimension AXIS in stored order (key_offsets' or value_offsets' AS_STORED) -> the same tile
    in order, and the other way round (SWAP is its own inverse): a register permutation."""
    R: tl.constexpr = tile.shape[0]
    C: tl.constexpr = tile.shape[1]
    if AXIS == 1:
        return tl.reshape(tl.permute(tl.reshape(tile, (R, C // 4, 2, 2)), (0, 1, 3, 2)), (R, C))
    else:   # (an early return would still build this reshape, which fails for tiles under 4 rows: a CPU test)
        return tl.reshape(tl.permute(tl.reshape(tile, (R // 4, 2, 2, C)), (0, 2, 1, 3)), (R, C))


@triton.constexpr_function
def in_words(columns: int) -> bool:
    """Whether a plane's stored rows of `columns` bytes are whole 4-byte words, all in SWAP's order: a Triton
    kernel can then move a tile of it as whole words as stored, and put it (or the other operand of a product with
    it) in order in registers (in_order). The tile's columns (keys) or tokens (values) must start at a multiple of 4
    and run on in order, as they all do."""
    return columns % 4 == 0


# The Triton kernels' tiles of a plane, read or written in column order: where the plane's rows are whole words as
# stored and put in order in registers (in_words), else byte by byte.
@triton.jit
def key_tile(ptr, j, d, mask, G4: tl.constexpr, K: tl.constexpr):
    """The (rows j, columns d) tile of the key plane at ptr (K columns wide), columns in order (0 where masked)."""
    if in_words(key_chunk(K)):
        return in_order(tl.load(ptr + key_offsets(j, d, G4, K, True), mask=mask, other=0), 1)
    else:
        return tl.load(ptr + key_offsets(j, d, G4, K), mask=mask, other=0)


@triton.jit
def store_key_tile(ptr, j, d, tile, mask, G4: tl.constexpr, K: tl.constexpr):
    """Write the (rows j, columns d) tile into the key plane at ptr, as key_tile reads it."""
    if in_words(key_chunk(K)):
        tl.store(ptr + key_offsets(j, d, G4, K, True), in_order(tile, 1), mask=mask)
    else:
        tl.store(ptr + key_offsets(j, d, G4, K), tile, mask=mask)


@triton.jit
def key_tile_and_operand(ptr, j, d, mask, b, G4: tl.constexpr, K: tl.constexpr):
    """For a product over the tile's columns with b (columns, ...): key_tile's tile and b, with the tile as stored
    and b's rows put in that order where the plane is in whole words (b is the smaller one to move), else both in
    column order."""
    if in_words(key_chunk(K)):
        return tl.load(ptr + key_offsets(j, d, G4, K, True), mask=mask, other=0), in_order(b, 0)
    else:
        return tl.load(ptr + key_offsets(j, d, G4, K), mask=mask, other=0), b


@triton.jit
def value_tile(ptr, c, t, mask, G: tl.constexpr, D4: tl.constexpr, TOKENS: tl.constexpr):
    """The tile of channel bytes c and tokens t (broadcast against each other, tokens along dimension TOKENS) of the
    value plane at ptr, tokens in order (0 where masked)."""
    if in_words(G // 4):
        return in_order(tl.load(ptr + value_offsets(c, t, G, D4, True), mask=mask, other=0), TOKENS)
    else:
        return tl.load(ptr + value_offsets(c, t, G, D4), mask=mask, other=0)


@triton.jit
def value_tile_and_operand(ptr, c, t, mask, b, G: tl.constexpr, D4: tl.constexpr):
    """For a product over the tile's tokens (dimension 1) with b (tokens, ...): value_tile's tile and b, as
    key_tile_and_operand's."""
    if in_words(G // 4):
        return tl.load(ptr + value_offsets(c, t, G, D4, True), mask=mask, other=0), in_order(b, 0)
    else:
        return tl.load(ptr + value_offsets(c, t, G, D4), mask=mask, other=0), b


@triton.jit
def store_value_tile(ptr, c, t, tile, mask, G: tl.constexpr, D4: tl.constexpr, TOKENS: tl.constexpr):
    """Write the tile into the value plane at ptr, as value_tile reads it."""
    if in_words(G // 4):
        tl.store(ptr + value_offsets(c, t, G, D4, True), in_order(tile, TOKENS), mask=mask)
    else:
        tl.store(ptr + value_offsets(c, t, G, D4), tile, mask=mask)


def pack_quarters(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 2-bit codes along `dim` (length n, a multiple of 4) into n/4 bytes: element j + i*n/4 lands in
    byte j at bits 2i."""
    q = codes.to(torch.int32).movedim(dim, -1)
    q = q.reshape(*q.shape[:-1], 4, q.shape[-1] // 4)
    shifts = torch.arange(0, 8, 2, device=q.device, dtype=torch.int32).unsqueeze(-1)
    return ((q & 3) << shifts).sum(-2).to(torch.uint8).movedim(-1, dim).contiguous()


def unpack_quarters(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of pack_quarters: n/4 bytes along `dim` -> n int32 codes in 0..3."""
    p = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-2)
    shifts = torch.arange(0, 8, 2, device=p.device, dtype=torch.int32).unsqueeze(-1)
    q = (p >> shifts) & 3
    return q.reshape(*q.shape[:-2], 4 * q.shape[-1]).movedim(-1, dim)


def boost_mask(ch: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(..., NB) boosted-channel lists -> (..., D) bool masks, True where a channel is stored at 4 bits."""
    mask = torch.zeros((*ch.shape[:-1], head_dim), dtype=torch.bool, device=ch.device)
    return mask.scatter_(-1, ch.long(), True) if ch.shape[-1] else mask


@dataclass
class PagedKV:
    """One layer's cache as the attention kernels read it (B sequences, H KV heads, head_dim D).

    Token t of sequence b lives in:
      keys:   k_fp[b, :, t] if t < sink; key page k_table[b, p] slot i if t = sink + p*G + i and p < n_kpages[b];
              else k_fp[b, :, sink + (t - sink - n_kpages[b]*G)]  (the key Q-buffer, or everything for 16-bit keys)
      values: the same with v_fp, v_table and n_vpages (the FP16 tail there is value Q-buffer + local window).
    """

    k_fp: torch.Tensor          # (B, H, CK, D) 16-bit
    v_fp: torch.Tensor          # (B, H, CV, D)
    k_low: torch.Tensor         # (P, H, D/32, G/4, 32) uint8 (key_plane_shape)
    k_high: torch.Tensor        # (P, H, NB/C', G/4, C') uint8
    k_ch: torch.Tensor          # (P, H, NB) uint8
    k_scale: torch.Tensor       # (P, H, D) fp16
    k_zero: torch.Tensor        # (P, H, D) fp16
    v_low: torch.Tensor         # (P', H, 4, D/4, G/4) uint8 (value_plane_shape)
    v_high: torch.Tensor        # (P', H, 4 or 0, D/4, G/4) uint8
    v_scale: torch.Tensor       # (P', H, G) fp16
    v_zero: torch.Tensor        # (P', H, G) fp16
    k_table: torch.Tensor       # (B, MP) int32 page ids
    v_table: torch.Tensor       # (B, MP) int32
    seq_len: torch.Tensor       # (B,) int32 valid tokens (padding is never stored)
    n_kpages: torch.Tensor      # (B,) int32
    n_vpages: torch.Tensor      # (B,) int32
    sink: int
    page_size: int
    n_boost: int
    v_bits: int
