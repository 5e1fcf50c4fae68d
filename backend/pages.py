"""A pool of fixed-size pages (PagedAttention style) and per-sequence page tables.

Pages are written once (when a buffer of G tokens is quantized) and never change, so sequences may share them
(beam search reorders rows of the page table, not pages). Storage grows by exactly the pages asked for, so the
bytes a cache reports are the bytes its pages take; `reserve` grows it ahead of time for speed-critical runs.
"""
from __future__ import annotations

import numpy as np
import torch


class PagePool:
    """Named tensors of shape (capacity, *page_shape); one page id indexes all of them.

    `diagnostics` names tensors kept beside the pages for analysis only (not part of the cache's bytes)."""

    def __init__(self, page_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device,
                 diagnostics: tuple[str, ...] = ()):
        self.tensors = {name: torch.empty((0, *shape), dtype=dtype, device=device)
                        for name, (shape, dtype) in page_shapes.items()}
        self.diagnostics = diagnostics
        # pages are taken in order and only given back all at once (release_all), so the free ones are always the
        # ids [first_free, capacity): no list to slice at every page boundary of every layer
        self.first_free = 0
        self.in_use = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def free(self) -> range:
        return range(self.first_free, self.capacity)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.tensors.items() if name not in self.diagnostics)

    def reserve(self, pages: int) -> None:
        """Grow the storage so that `pages` more pages can be allocated without reallocation."""
        grow = pages - len(self.free)
        if grow > 0:
            self.tensors = {name: torch.cat([t, t.new_empty((grow, *t.shape[1:]))])
                            for name, t in self.tensors.items()}

    def allocate(self, n: int) -> np.ndarray:
        self.reserve(n)
        ids = np.arange(self.first_free, self.first_free + n)
        self.first_free += n
        self.in_use += n
        return ids

    def write(self, index: torch.Tensor, **values: torch.Tensor) -> None:
        """Page index[k] (a device tensor of ids) gets values[name][k]."""
        for name, value in values.items():
            self.tensors[name][index] = value

    def release_all(self) -> None:
        self.first_free = 0
        self.in_use = 0


class PageTable:
    """(batch, max_pages) int32 page ids per sequence, with page counts kept on the host as well (a numpy array:
    deciding when to quantize needs no GPU sync) and on the device (for the kernels). `columns`: pages per
    sequence to make room for up front (the table grows by doubling past them)."""

    def __init__(self, batch: int, device, columns: int = 0):
        self.ids = torch.full((batch, columns), -1, dtype=torch.int32, device=device)
        self.counts = np.zeros(batch, dtype=np.int64)
        self.device_counts = torch.zeros(batch, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.device_counts.numel() * 4

    def slots(self, seqs: np.ndarray) -> np.ndarray:
        """Columns where sequences seqs (a sequence may appear several times, in order) put their next pages;
        the table grows (doubling) to hold them."""
        cols = self.counts[seqs] + occurrence_rank(seqs)
        need = int(cols.max()) + 1 if len(cols) else 0
        if need > self.ids.shape[1]:
            grow = max(need, 2 * self.ids.shape[1]) - self.ids.shape[1]
            self.ids = torch.cat([self.ids, self.ids.new_full((self.ids.shape[0], grow), -1)], dim=1)
        return cols

    def append(self, seqs: np.ndarray, rows: torch.Tensor, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """Record pages ids at (rows, cols) from `slots`: seqs on the host, the same rows / cols / ids as device
        tensors (see DeviceIndices)."""
        self.ids[rows, cols] = ids.to(torch.int32)
        self.device_counts.index_add_(0, rows, torch.ones_like(rows, dtype=torch.int32))
        self.count(seqs)

    def count(self, seqs: np.ndarray) -> None:
        """The host side of `append` alone, for pages whose device side a kernel wrote (kernels/flush.py)."""
        self.counts += np.bincount(seqs, minlength=len(self.counts))

    def pages_of(self, seq: int) -> list[int]:
        return self.ids[seq, :self.counts[seq]].tolist()

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (beam reorder / repeat / select); shared pages stay valid (pages are immutable)."""
        self.ids = self.ids[index.to(self.ids.device)]
        self.counts = self.counts[index.cpu().numpy()]
        self.device_counts = self.device_counts[index.to(self.ids.device)]


class DeviceIndices:
    """Host integer arrays -> int64 device tensors with one asynchronous copy from pinned memory.

    A plain `.to(device)` of pageable host memory synchronizes the stream, so every layer of a decode step
    that quantizes pages would wait for the GPU to drain. Each call takes the next of a few pinned buffers;
    the event recorded after its previous copy has long completed by the time the ring comes back to it.

    The layers of one cache share an instance (KittyCache): they make their pages in lockstep, so at a page
    boundary every layer asks for the same rows, page ids and table columns. A call whose arrays equal one of the
    last RECENT calls' returns that call's tensors (read-only indices) instead of copying again: one copy per
    step instead of one per layer. A further prompt chunk (a chat's next turn) makes 9 different calls a layer
    (tests/test_cache.py), so RECENT holds more than that: with 4, every layer missed and copied all 9 again, and
    with a ring of 4 every copy first waited for the GPU to reach the copy four calls back."""

    RING = 16
    RECENT = 16

    def __init__(self, device):
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor | None] = [None] * self.RING
        self.copied: list[torch.cuda.Event | None] = [None] * self.RING
        self.turn = 0
        self.recent: list[tuple[tuple[int, ...], np.ndarray, list[torch.Tensor]]] = []

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        # each array starts at an even element (16 bytes): Triton specializes a kernel on whether its pointers are
        # 16-byte aligned, so with odd lengths the fused flush compiled anew when the batch changed parity (a 2.3 s
        # decode step on the H200, BENCHMARKS.md section 2)
        sizes = tuple(len(a) for a in arrays)
        starts = np.concatenate([[0], np.cumsum([n + n % 2 for n in sizes])])
        flat = np.zeros(int(starts[-1]), dtype=np.int64)
        for start, a in zip(starts, arrays):
            flat[start:start + len(a)] = a
        for seen_sizes, seen, tensors in self.recent:
            if seen_sizes == sizes and np.array_equal(seen, flat):
                return tensors
        tensors = self._copy(flat, starts, sizes)
        self.recent = [(sizes, flat, tensors), *self.recent[:self.RECENT - 1]]
        return tensors

    def _copy(self, flat: np.ndarray, starts: np.ndarray, sizes: tuple[int, ...]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            out = torch.from_numpy(flat.copy()).to(self.device)
            return [out[start:start + n] for start, n in zip(starts, sizes)]
        slot, self.turn = self.turn, (self.turn + 1) % self.RING
        buf = self.buffers[slot]
        if buf is None or buf.numel() < len(flat):
            buf = self.buffers[slot] = torch.empty(max(len(flat), 256), dtype=torch.int64, pin_memory=True)
        elif self.copied[slot] is not None:
            self.copied[slot].synchronize()
        buf[:len(flat)].numpy()[:] = flat
        out = buf[:len(flat)].to(self.device, non_blocking=True)
        self.copied[slot] = torch.cuda.Event()
        self.copied[slot].record()
        return [out[start:start + n] for start, n in zip(starts, sizes)]


def occurrence_rank(values: np.ndarray) -> np.ndarray:
    """For each element, how many equal elements come before it: [3, 1, 3, 3] -> [0, 0, 1, 2]."""
    values = np.asarray(values)
    if (values[1:] > values[:-1]).all():                   # distinct and ascending: a decode step's due rows
        return np.zeros(len(values), dtype=np.int64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    rank = np.arange(len(values)) - np.repeat(starts, np.diff(np.append(starts, len(values))))
    out = np.empty_like(rank)
    out[order] = rank
    return out


def ragged_ranges(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, offsets) of sizes[b] consecutive items per row b: [2, 0, 3] -> ([0, 0, 2, 2, 2], [0, 1, 0, 1, 2])."""
    sizes = np.asarray(sizes, dtype=np.int64)
    rows = np.repeat(np.arange(len(sizes)), sizes)
    return rows, np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
