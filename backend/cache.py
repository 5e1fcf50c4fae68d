"""The Kitty KV cache as a transformers `Cache`: one `KittyLayer` per attention layer.

Per layer, sequence and KV head (D = head_dim, S = sink, G = page size, R = value window):
  keys:   [sink: S tokens full precision | key pages of G tokens | key Q-buffer < G tokens full precision]
  values: [sink | value pages of G tokens | value tail: Q-buffer + local window of R, full precision]
Full-precision parts live in `k_fp` / `v_fp` (B, H, capacity, D): the sink at [0, S), the key Q-buffer or the
value tail from S on. 16-bit keys or values never fill a page: their tail simply grows.

Work per step (the paper's three stages): new tokens go into the full-precision buffers; attention reads
[sink | pages | buffers] (Triton on a GPU, the PyTorch reference on a CPU); then a buffer that holds G tokens
(keys) or R + G tokens (values) becomes one page. Padding (left-padded batches) is never stored: each
sequence's buffers and pages hold only its own tokens, tracked by per-sequence lengths.

The layer does its work inside the registered attention function (backend/attention.py): `update` only tags
the new key tensor with its layer, because transformers calls `update` before attention with no mask.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kernels import dequantize, flush, quantize
from kernels.chunk_attention import chunk_attention
from kernels.decode_attention import (DecodeWorkspace, check_kernel, decode_attention, decode_attention_ref,
                                      kernel_parts)
from kernels.i8_reference import I8_KERNELS, decode_attention_i8_ref
from kernels.layout import (FP_DTYPE, SCALE_DTYPE, PagedKV, boost_mask, key_page_bytes, key_plane_shape,
                            value_page_bytes, value_plane_shape)

from .memory import FP_BYTES, TABLE_ENTRY_BYTES
from .methods import CacheConfig
from .pages import DeviceIndices, PagePool, PageTable, ragged_ranges

# How a decode step's full buffers become pages (KittyLayer's `flush`)
FLUSH_MODES = ("auto", "torch", "fused")

# flush_spread="auto" (the default): at most this many sequences' pages a decode step. Measured on the H200 at 512 +
# 8,192 tokens, each page-boundary step against the ordinary steps around it (BENCHMARKS.md section 2, session 19):
# 16 a step (204 sequences, spread 13) 1.08x at the median and 1.14x at the slowest, within the 15 % bar; 24 a step
# 1.08x / 1.17x; all at once (the paper's schedule, 207 sequences) 1.57x / 1.83x.
FLUSH_SEQUENCES_PER_STEP = 16


def auto_flush_spread(batch: int) -> int:
    """flush_spread="auto" for a batch: the fewest steps that make at most FLUSH_SEQUENCES_PER_STEP sequences'
    pages each (1, the paper's schedule, up to 16 sequences)."""
    return max(1, -(-batch // FLUSH_SEQUENCES_PER_STEP))

# The PyTorch reference path of a further chunk dequantizes its cache's pages this many elements at a time (256 MB
# in bf16), so its transient on top of the dense keys / values stays bounded (the Triton path has none: it writes
# the pages straight into the dense tensor)
DEQUANT_ELEMENTS = 2 ** 27


class KittyLayer(CacheLayerMixin):
    """One attention layer's cache (see the module doc). Options as in backend.make_cache, which documents them."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, config: CacheConfig, layer_idx: int = 0, use_triton: bool | None = None,
                 record_magnitudes: bool = True, reserve_tokens: int = 0, flush_spread: int | str = "auto",
                 flush: str = "auto", shared_indices: dict | None = None, decode_kernel: str = "auto"):
        super().__init__()
        if flush_spread != "auto" and (isinstance(flush_spread, bool) or not isinstance(flush_spread, int)
                                       or flush_spread < 1):
            raise ValueError(f"flush_spread={flush_spread!r} must be a positive integer (1: the paper's schedule) or "
                             "'auto' (by batch size: auto_flush_spread)")
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush={flush!r} must be one of {FLUSH_MODES}: 'torch' quantizes a decode step's full "
                             "buffers with separate torch ops, 'fused' with one Triton kernel per kind, 'auto' "
                             "(default) fused on a GPU")
        try:
            check_kernel(decode_kernel)
        except ValueError as error:
            raise ValueError(f"decode_kernel={decode_kernel!r}: the decode-attention kernel over a GPU cache's pages "
                             f"('auto', the default, picks the faster for the launch). {error}") from None
        self.config = config
        self.layer_idx = layer_idx
        self.use_triton = use_triton            # None: Triton for CUDA tensors, the PyTorch reference otherwise
        self.record_magnitudes = record_magnitudes
        self.reserve_tokens = reserve_tokens    # page storage to set aside per sequence (no reallocation later)
        self.spread_setting = flush_spread      # what was asked: steps, or "auto" (set per batch at initialization)
        self.flush_spread = flush_spread        # decode steps over which a batch's full buffers become pages
        self.flush = flush                      # how a decode step's full buffers become pages (FLUSH_MODES)
        self.decode_kernel = decode_kernel      # decode_attention's kernel over the pages (check_kernel)
        # what this layer shares with the other layers of its cache (None: nothing): device -> DeviceIndices, and
        # "prompt_lengths" -> the last attention mask read (_prompt_lengths)
        self.shared_indices = shared_indices
        self.seen = 0                           # positions seen, padding included (what masks are sized by)

    # ------------------------------------------------------------------------------------------ set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        bsz, heads, _, dim = key_states.shape
        if dim % 4:
            raise ValueError(f"head_dim={dim} is not a multiple of 4: 2-bit codes are packed 4 per byte")
        if dim > 256:
            raise ValueError(f"head_dim={dim} is larger than 256: boosted channels are stored as uint8 ids")
        self.n_boost = cfg.boosted_channels(dim)
        self.dtype, self.device = key_states.dtype, key_states.device
        # Full-precision parts are stored at 16 bits whatever the model computes in (as in the paper): the model's
        # own half type, or FP16 for a float32 model (a CPU run), cast on read.
        self.store_dtype = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else FP_DTYPE
        self.batch, self.heads, self.head_dim = bsz, heads, dim
        if self.spread_setting == "auto":
            self.flush_spread = auto_flush_spread(bsz)
        self.lengths = np.zeros(bsz, dtype=np.int64)            # host copy of seq_len: decisions without a sync
        self.seq_len = torch.zeros(bsz, dtype=torch.int32, device=self.device)
        s, g, r = cfg.sink, cfg.page_size, cfg.local_window
        # Zeros, not empty: the SDPA path reads whole rows and 0 * NaN garbage would poison its output.
        # A full buffer may wait up to flush_spread - 1 steps for its turn to become a page: room for that.
        wait = self.flush_spread - 1
        fp = dict(dtype=self.store_dtype, device=self.device)
        self.k_fp = torch.zeros((bsz, heads, s + (g + wait if cfg.k_bits < 16 else 0), dim), **fp)
        self.v_fp = torch.zeros((bsz, heads, s + (r + g + wait if cfg.v_bits < 16 else 0), dim), **fp)
        self.key_pool = PagePool({
            "low": (key_plane_shape(heads, g, dim), torch.uint8),
            "high": (key_plane_shape(heads, g, self.n_boost), torch.uint8),
            "ch": ((heads, self.n_boost), torch.uint8), "scale": ((heads, dim), SCALE_DTYPE),
            "zero": ((heads, dim), SCALE_DTYPE),
            # a diagnostic (stats, plots), not part of the cache's bytes: no storage when it is not recorded
            "magnitude": ((heads, dim if self.record_magnitudes else 0), SCALE_DTYPE),
        }, self.device, diagnostics=("magnitude",))
        self.value_pool = PagePool({
            "low": (value_plane_shape(heads, dim, g), torch.uint8),
            "high": (value_plane_shape(heads, dim, g, cfg.v_bits == 4), torch.uint8),
            "scale": ((heads, g), SCALE_DTYPE), "zero": ((heads, g), SCALE_DTYPE),
        }, self.device)
        # reserve_tokens sizes the page tables too: a table that grows moves, and a captured decode step with it
        per_sequence = -(-max(0, self.reserve_tokens - s) // g)
        self.key_table = PageTable(bsz, self.device, per_sequence if cfg.k_bits < 16 else 0)
        self.value_table = PageTable(bsz, self.device, per_sequence if cfg.v_bits < 16 else 0)
        if self.shared_indices is None:
            self.to_device = DeviceIndices(self.device)
        else:
            self.to_device = self.shared_indices.setdefault(self.device, DeviceIndices(self.device))
        self.workspace = DecodeWorkspace()
        # Query-aware selection: per sequence, KV head and channel, the sum of q_c^2 over the queries seen so far,
        # and its value when the sequence's newest key buffer filled (its page is chosen with that one)
        self.query_aware = cfg.selection == "query" and 0 < self.n_boost < dim
        if self.query_aware:
            self.q_energy = torch.zeros((bsz, heads, dim), dtype=torch.float64, device=self.device)
            self.q_energy_at_fill = torch.zeros_like(self.q_energy)
        if per_sequence:
            if cfg.k_bits < 16:
                self.key_pool.reserve(bsz * per_sequence)
            if cfg.v_bits < 16:
                self.value_pool.reserve(bsz * per_sequence)
        self.is_initialized = True

    def _triton(self) -> bool:
        return self.device.type == "cuda" if self.use_triton is None else self.use_triton

    # ------------------------------------------------------------------------------------------ transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        tagged = key_states.view_as(key_states)
        tagged.kitty_layer = self               # found by backend.attention.kitty_attention
        return tagged, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(torch.arange(self.batch).repeat_interleave(repeats))

    def _select(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        dev = index.to(self.device)
        self.k_fp, self.v_fp, self.seq_len = self.k_fp[dev], self.v_fp[dev], self.seq_len[dev]
        self.lengths = self.lengths[index.cpu().numpy()]
        self.key_table.select(index)
        self.value_table.select(index)
        self.batch = len(self.lengths)
        if self.query_aware:
            self.q_energy, self.q_energy_at_fill = self.q_energy[dev], self.q_energy_at_fill[dev]

    # ------------------------------------------------------------------------------------------ attention
    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """Attention output (B, q_len, HQ, D) for the new tokens, storing them in the cache."""
        if self.store_dtype != key.dtype:             # every attention sees the tokens as stored: at 16 bits
            key, value = (t.to(self.store_dtype).to(t.dtype) for t in (key, value))
        first = self.seen == key.shape[2]                           # nothing before: the prompt or its first chunk
        if query.shape[2] == 1 and not first:                       # decode: insert, attend, quantize
            self._insert_one(key[:, :, 0], value[:, :, 0])
            self._observe_queries(query, np.ones(self.batch, dtype=np.int64))
            out = self._decode(module, query, scaling, **kwargs)
            self._quantize_full_buffers()
            return out
        # Real tokens per sequence, at the end of this call's tokens: with left padding and chunked prefill a
        # sequence's padding may reach into later chunks (or fill the first), so every chunk reads its mask
        counts = self._prompt_lengths(attention_mask, key.shape[2], key.shape[0])
        if first:                                                   # FP16 attention over the prompt
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        else:                                                       # a further chunk on a (maybe empty) cache
            out = self._attend_chunk(query, key, value, scaling, counts)
        self._append(key, value, counts, self._observe_queries(query, counts))
        return out

    def _prompt_lengths(self, attention_mask: torch.Tensor | None, width: int, batch: int) -> list[int]:
        """prompt_lengths, read once per forward: every layer of a cache gets the same mask tensor, and each read
        waits for the GPU (the host needs the counts), so the layers after the first take the first one's answer
        while that tensor lives (a weak reference: a new forward's mask is a new tensor)."""
        if attention_mask is None or self.shared_indices is None:
            return prompt_lengths(attention_mask, width, batch)
        mask, shape, counts = self.shared_indices.get("prompt_lengths", (None, None, None))
        if mask is None or mask() is not attention_mask or shape != (width, batch):
            counts = prompt_lengths(attention_mask, width, batch)
            self.shared_indices["prompt_lengths"] = (weakref.ref(attention_mask), (width, batch), counts)
        return counts

    def _observe_queries(self, query: torch.Tensor, counts) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Query-aware selection: add the new tokens' q_c^2 (summed over each KV head's query heads, post-RoPE;
        the last counts[b] of the chunk are real, the rest padding) to each sequence's running sum. Returns the
        sums before the chunk (B, H, D) and the chunk's running sums (B, H, n, D): a page whose last token is chunk
        position i is chosen with before + running[:, :, i], the queries of its own and earlier tokens only, so a
        page's choice never depends on later queries. None for other selections."""
        if not self.query_aware:
            return None
        b, hq, n, d = query.shape
        energy = query.float().square().reshape(b, self.heads, hq // self.heads, n, d).sum(2)
        pad = n - np.asarray(counts)
        if pad.any():
            real = torch.arange(n, device=self.device)[None, :] >= self.to_device(pad)[0][:, None]
            energy = energy * real[:, None, :, None]
        running = energy.cumsum(2)
        before = self.q_energy.clone()
        self.q_energy += running[:, :, -1]           # in place: a captured decode step (backend.graphs) replays it
        return before, running

    def paged(self) -> PagedKV:
        kp, vp = self.key_pool.tensors, self.value_pool.tensors
        cfg = self.config
        return PagedKV(self.k_fp, self.v_fp, kp["low"], kp["high"], kp["ch"], kp["scale"], kp["zero"],
                       vp["low"], vp["high"], vp["scale"], vp["zero"], self.key_table.ids, self.value_table.ids,
                       self.seq_len, self.key_table.device_counts, self.value_table.device_counts,
                       cfg.sink, cfg.page_size, self.n_boost, cfg.v_bits)

    def _decode(self, module, query, scaling, **kwargs) -> torch.Tensor:
        if self.config.is_full_precision:
            # No page anywhere: SDPA over the contiguous buffers, as transformers' own cache would run it
            longest = int(self.lengths.max())
            mask = None
            if self.lengths.min() != longest:
                mask = (torch.arange(longest, device=self.device) < self.seq_len[:, None])[:, None, None, :]
            keys, values = (t[:, :, :longest].to(query.dtype) for t in (self.k_fp, self.v_fp))
            out, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=scaling, **kwargs)
            return out
        if self._triton():
            return decode_attention(query[:, :, 0], self.paged(), scaling, workspace=self.workspace,
                                    kernel=self.decode_kernel).unsqueeze(1)
        i8 = I8_KERNELS.get(kernel_parts(self.decode_kernel)[0])
        if i8 is not None:                          # the 8-bit kernels' arithmetic (their accuracy, on a CPU)
            return decode_attention_i8_ref(query[:, :, 0], self.paged(), scaling, values=i8).unsqueeze(1)
        return decode_attention_ref(query[:, :, 0], self.paged(), scaling).unsqueeze(1)

    def _attend_chunk(self, query, key, value, scaling, counts=None) -> torch.Tensor:
        """A chunk of n tokens on the cache (the next chunk of a chunked prefill, or a further prompt such as the next
        turn of a chat): each sequence's real queries attend over its cached tokens as decode reads them (pages
        dequantized, sink and buffers at 16 bits) and over the chunk's real tokens causally. counts[b]: sequence b's
        real tokens, the last of the chunk (left padding before them); None: all real. Returns (B, n, HQ, D), zeros in
        padding rows.

        Keys and values are laid out [cached | real chunk tokens] per sequence and attended in one Triton launch on a
        GPU, else with lower-right causal SDPA once per run of equal lengths (kernels/chunk_attention.py)."""
        counts = np.full(query.shape[0], query.shape[2]) if counts is None else np.asarray(counts)
        keys = self._dense("key", query.dtype, key, counts)
        values = self._dense("value", query.dtype, value, counts)
        lengths = self.to_device(self.lengths, counts) if self._triton() else None      # pinned, no stream sync
        return chunk_attention(query, keys, values, self.lengths, counts, scaling, self._triton(), lengths)

    def _dense(self, kind: str, dtype: torch.dtype, chunk: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
        """Every sequence's keys or values in token order, then the last counts[b] tokens of `chunk` (B, H, n, D):
        (B, H, max(lengths + counts), D) in `dtype`, zeros past each sequence's end. One allocation, written in place:
        sink, dequantized pages, the full-precision buffer (vectorized over sequences and pages), the chunk."""
        cfg = self.config
        s, g = cfg.sink, cfg.page_size
        fp, table = (self.k_fp, self.key_table) if kind == "key" else (self.v_fp, self.value_table)
        width = int((self.lengths + counts).max())
        out = torch.zeros((self.batch, width, self.heads, self.head_dim), dtype=dtype, device=self.device)
        # dequantized pages: straight into their rows (one launch); the reference a bounded slice at a time
        seqs, cols = np.nonzero(np.arange(table.ids.shape[1])[None, :] < table.counts[:, None])
        pool = (self.key_pool if kind == "key" else self.value_pool).tensors
        write = dequantize.dequantize_pages_into if self._triton() else dequantize.dequantize_pages_into_ref
        step = max(1, len(seqs) if self._triton() else DEQUANT_ELEMENTS // (self.heads * g * self.head_dim))
        for i in range(0, len(seqs), step):
            rows_d, cols_d = self.to_device(seqs[i:i + step], cols[i:i + step])
            write(out, kind, pool, table.ids[rows_d, cols_d], rows_d, s + cols_d * g)
        # full-precision part: token t < sink at t, else (after the pages) at sink + t - sink - pages * G. The
        # positions come from the host's lengths and page counts (a device nonzero() waited for the GPU at every
        # layer of a chat's next turn)
        first = s + table.counts * g                                                  # first buffered token
        sink_rows, sink_at = ragged_ranges(np.minimum(self.lengths, s))
        buffer_rows, buffer_at = ragged_ranges(np.clip(np.minimum(self.lengths, first + fp.shape[2] - s) - first, 0,
                                                       None))
        rows_d, where_d, src_d = self.to_device(np.concatenate([sink_rows, buffer_rows]),
                                                np.concatenate([sink_at, first[buffer_rows] + buffer_at]),
                                                np.concatenate([sink_at, s + buffer_at]))
        out[rows_d, where_d] = fp[rows_d, :, src_d].to(dtype)
        # the chunk's real tokens right after each sequence's cached ones
        n = chunk.shape[2]
        rows, cols = np.nonzero(np.arange(n)[None, :] >= (n - counts)[:, None])
        rows_d, cols_d, where_d = self.to_device(rows, cols, self.lengths[rows] + cols - (n - counts)[rows])
        out[rows_d, where_d] = chunk[rows_d, :, cols_d].to(dtype)
        return out.transpose(1, 2)

    # ------------------------------------------------------------------------------------------ graph replay
    def graphable(self) -> bool:
        """Whether a decode step can be captured and replayed as a CUDA graph (backend.graphs): both sides
        quantized (a 16-bit side grows its buffer and an fp16 cache slices by the longest sequence, on the host)."""
        return self.is_initialized and self.config.k_bits < 16 and self.config.v_bits < 16

    def next_decode_is_ordinary(self) -> bool:
        """Whether the next decode step only inserts one token per sequence and attends: no buffer reaches a page
        (nor waits for its turn, nor records its queries). Every decode step does that GPU work first; a step that
        is not ordinary then quantizes (`_quantize_full_buffers`), which reads and writes only this layer's
        storage, so it may as well run after the whole step's forward. Host arithmetic, no sync."""
        cfg = self.config
        keys, values = self._buffered(self.lengths + 1)
        return not ((keys >= cfg.page_size).any() or (values >= cfg.local_window + cfg.page_size).any())

    def replayed_decode_step(self, ordinary: bool = True) -> None:
        """For a decode step whose insert-and-attend GPU work ran as a graph replay: its host-side effect (`update`
        and `_insert_one`), then, unless `ordinary` (next_decode_is_ordinary before the step), the quantization
        of full buffers that the eager step would have run after this layer's attention."""
        self.seen += 1
        self.lengths += 1
        if not ordinary:
            self._quantize_full_buffers()

    def storage_pointers(self) -> tuple[int, ...]:
        """Addresses of every tensor a decode step reads or writes: a captured step is valid while they stay."""
        tensors = [self.k_fp, self.v_fp, self.seq_len, *self.key_pool.tensors.values(),
                   *self.value_pool.tensors.values(), self.key_table.ids, self.key_table.device_counts,
                   self.value_table.ids, self.value_table.device_counts, *self.workspace.buffers]
        if self.query_aware:
            tensors.append(self.q_energy)
        return tuple(t.data_ptr() for t in tensors)

    # ------------------------------------------------------------------------------------------ storing tokens
    def _insert_one(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Decode step: one token per sequence into the sink or the full-precision buffers, without a host sync."""
        cfg = self.config
        self._grow_fp(int(self.lengths.max()) + 1)
        rows = torch.arange(self.batch, device=self.device)
        # Token t sits at t in the sink, else at t - pages*G (sink + offset in the buffer): one formula for both
        k_pos = self.seq_len - self.key_table.device_counts * cfg.page_size
        v_pos = self.seq_len - self.value_table.device_counts * cfg.page_size
        self.k_fp[rows, :, k_pos.long()] = key.to(self.store_dtype)
        self.v_fp[rows, :, v_pos.long()] = value.to(self.store_dtype)
        self.seq_len += 1
        self.lengths += 1

    def _grow_fp(self, tokens: int) -> None:
        """16-bit keys / values keep every token after the sink: grow their buffer (doubling) to hold `tokens`."""
        for name, bits in (("k_fp", self.config.k_bits), ("v_fp", self.config.v_bits)):
            buf = getattr(self, name)
            if bits == 16 and buf.shape[2] < tokens:
                bigger = buf.new_zeros((*buf.shape[:2], max(tokens, 2 * buf.shape[2]), buf.shape[3]))
                bigger[:, :, :buf.shape[2]] = buf
                setattr(self, name, bigger)

    def _append(self, key: torch.Tensor, value: torch.Tensor, counts, queries=None) -> None:
        """Append the last counts[b] tokens of key/value (B, H, n, D) to each sequence, quantizing full buffers;
        `queries`: what _observe_queries returned for this chunk. No loop over sequences: the index arithmetic runs
        on the host, the moves are a few gathers and scatters for the whole batch."""
        cfg = self.config
        s, g = cfg.sink, cfg.page_size
        counts = np.asarray(counts, dtype=np.int64)
        lengths = self.lengths.copy()
        self._grow_fp(int((lengths + counts).max()))
        first = key.shape[2] - counts                               # chunk position of each sequence's first token
        take = np.clip(s - lengths, 0, counts)                      # the sink fills first
        if take.any():
            rows, offsets = ragged_ranges(take)
            rows_d, src_d, dst_d = self.to_device(rows, first[rows] + offsets, lengths[rows] + offsets)
            self.k_fp[rows_d, :, dst_d] = key[rows_d, :, src_d].to(self.k_fp.dtype)
            self.v_fp[rows_d, :, dst_d] = value[rows_d, :, src_d].to(self.v_fp.dtype)
        key_rows, key_index, key_x = self._extend_buffers(self.k_fp, key, lengths + take, self.key_table.counts,
                                                          first + take, counts - take, keep=0, bits=cfg.k_bits)
        value_rows, _, value_x = self._extend_buffers(self.v_fp, value, lengths + take, self.value_table.counts,
                                                      first + take, counts - take, keep=cfg.local_window,
                                                      bits=cfg.v_bits)
        energy = None
        if queries is not None:
            before, running = queries
            # chunk position of each new key page's last token (sequence position s + (page + 1) * G - 1)
            pages = self.key_table.counts[key_rows].astype(np.int64) + key_index
            ends = self.to_device(first[key_rows] - lengths[key_rows] + s + (pages + 1) * g - 1)[0]
            energy = lambda rows_d: before[rows_d] + running[rows_d, :, ends]
        self.lengths += counts
        self.seq_len.copy_(self.to_device(self.lengths)[0])          # pinned: a pageable copy waits for the GPU
        self._store_pages(key_rows, value_rows, lambda _: key_x, lambda _: value_x, energy)

    def _extend_buffers(self, buf, chunk, lengths, pages, starts, counts, keep, bits):
        """Put counts[b] tokens of chunk (B, H, n, D), from chunk position starts[b] on, after the content of
        sequence b's buffer (it holds lengths[b] tokens, pages[b] of them in pages); cut every G tokens beyond
        `keep` off as pages. Returns the new pages' sequences (in order), each page's index among its sequence's
        new pages and their tokens (N, H, G, D), or None for no page."""
        s, g = self.config.sink, self.config.page_size
        counts = np.asarray(counts, dtype=np.int64)
        some = counts > 0                                           # others keep their buffer as it is
        filled = np.where(some, lengths - s - pages.astype(np.int64) * g, 0)
        total = filled + counts
        n_pages = np.where(some, np.maximum(total - keep, 0) // g, 0) if bits < 16 else np.zeros_like(total)
        if not some.any():
            return n_pages[:0], n_pages[:0], None
        # [buffer content | new tokens] of every sequence, then the pages and what stays cut from it
        content = buf.new_empty((buf.shape[0], buf.shape[1], int(total.max()), buf.shape[3]))
        old_rows, old = ragged_ranges(filled)
        new_rows, new = ragged_ranges(counts)
        page_rows, page_index = ragged_ranges(n_pages)
        kept = total - n_pages * g
        kept_rows, kept_at = ragged_ranges(kept)
        (old_rows_d, old_d, new_rows_d, new_src_d, new_dst_d, page_rows_d, page_first_d, kept_rows_d, kept_src_d,
         kept_at_d) = self.to_device(old_rows, old, new_rows, starts[new_rows] + new, filled[new_rows] + new, page_rows,
                                     page_index * g, kept_rows, (n_pages * g)[kept_rows] + kept_at, kept_at)
        content[old_rows_d, :, old_d] = buf[old_rows_d, :, s + old_d]
        content[new_rows_d, :, new_dst_d] = chunk[new_rows_d, :, new_src_d].to(buf.dtype)
        tokens = None
        if len(page_rows):
            window = page_first_d[:, None] + torch.arange(g, device=buf.device)          # (N, G)
            tokens = content[page_rows_d[:, None], :, window].transpose(1, 2).contiguous()  # (N, H, G, D)
        buf[kept_rows_d, :, s + kept_at_d] = content[kept_rows_d, :, kept_src_d]
        return page_rows, page_index, tokens

    def _quantize_full_buffers(self) -> None:
        """After a decode step's attention: a key Q-buffer of G tokens, or a value tail of R + G, becomes a page
        (the oldest G tokens); see _due for which sequences take their turn. Host arithmetic on the lengths
        picks them (no GPU sync); one batched launch per kind."""
        cfg = self.config
        s, g, r = cfg.sink, cfg.page_size, cfg.local_window
        keys, values = self._buffered(self.lengths)
        none = np.zeros(0, dtype=np.int64)
        key_rows = self._due(keys, g) if cfg.k_bits < 16 else none
        value_rows = self._due(values, r + g) if cfg.v_bits < 16 else none
        energy = None
        if self.query_aware:
            # a key buffer that filled this step: its page is chosen with the queries up to its last token, also
            # when flush_spread makes it wait for its turn (the same pages as without waiting)
            filled = np.flatnonzero(keys == g)
            if len(filled):
                rows_d = self.to_device(filled)[0]
                self.q_energy_at_fill[rows_d] = self.q_energy[rows_d]
            energy = lambda rows_d: self.q_energy_at_fill[rows_d]
        if not len(key_rows) and not len(value_rows):
            return
        if self._fused_flush():
            self._flush_in_kernels(key_rows, value_rows)
            return
        k_index, v_index = self._store_pages(key_rows, value_rows, lambda rows: self.k_fp[rows, :, s:s + g],
                                             lambda rows: self.v_fp[rows, :, s:s + g], energy)
        # what stays full precision moves down by G: tokens that waited (keys), the window and waiters (values)
        wait = self.flush_spread - 1
        if len(key_rows) and wait:
            self.k_fp[k_index, :, s:s + wait] = self.k_fp[k_index, :, s + g:s + g + wait]
        if len(value_rows):
            self.v_fp[v_index, :, s:s + r + wait] = self.v_fp[v_index, :, s + g:s + g + r + wait]

    def _buffered(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence of these lengths, the tokens after the sink and the pages made so far: what the key
        Q-buffer and the value tail hold."""
        after_sink = lengths - np.minimum(lengths, self.config.sink)
        g = self.config.page_size
        return after_sink - self.key_table.counts * g, after_sink - self.value_table.counts * g

    def _due(self, buffered: np.ndarray, full: int) -> np.ndarray:
        """Sequences whose buffer (`buffered` tokens, a page once it holds `full`) becomes a page this step.
        flush_spread = 1 is the paper's schedule: every full buffer at once. With k > 1 a batch whose buffers fill
        together is quantized over k steps, ceil(B / k) sequences per step (fullest first), so no single step
        carries the whole batch's quantization; a buffer that has waited k - 1 steps (its capacity) always goes."""
        ready = np.flatnonzero(buffered >= full)
        quota = -(-self.batch // self.flush_spread)
        if len(ready) <= quota:
            return ready
        must = buffered[ready] >= full + self.flush_spread - 1
        waiting = ready[~must][np.argsort(-buffered[ready[~must]], kind="stable")]
        return np.sort(np.concatenate([ready[must], waiting[:max(0, quota - int(must.sum()))]]))

    def _store_pages(self, key_rows: np.ndarray, value_rows: np.ndarray, key_pages, value_pages,
                     key_energy=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize one page for each of key_rows (sequences, in order) and value_rows: key_pages(rows) and
        value_pages(rows) give their (N, H, G, D) tokens for device row indices, key_energy(rows) the queries'
        q_c^2 sums (N, H, D) that query-aware selection weighs the key pages' channels with. One batched launch
        per kind, and every index the GPU needs goes over in one asynchronous copy. Returns the key and value rows
        on the device."""
        cfg = self.config
        use_triton = self._triton()
        key_cols, _, (k_rows, k_ids, k_cols, v_rows, v_ids, v_cols) = self._place_pages(key_rows, value_rows)
        if len(key_rows):
            key_x = key_pages(k_rows)
            ch, magnitude = self._choose_boost(key_x, key_rows, key_cols, key_energy(k_rows) if key_energy else None)
            quant = quantize.quantize_keys if use_triton else quantize.quantize_keys_ref
            low, high, scale, zero = quant(key_x, ch, self.n_boost)
            fields = dict(low=low, high=high, ch=ch, scale=scale, zero=zero)
            if self.record_magnitudes:
                fields["magnitude"] = magnitude.to(SCALE_DTYPE)
            self.key_pool.write(k_ids, **fields)
            self.key_table.append(key_rows, k_rows, k_cols, k_ids)
        if len(value_rows):
            quant = quantize.quantize_values if use_triton else quantize.quantize_values_ref
            low, high, scale, zero = quant(value_pages(v_rows), cfg.v_bits)
            self.value_pool.write(v_ids, low=low, high=high, scale=scale, zero=zero)
            self.value_table.append(value_rows, v_rows, v_cols, v_ids)
        return k_rows, v_rows

    def _place_pages(self, key_rows: np.ndarray, value_rows: np.ndarray):
        """Page ids from the pools and page-table columns for one new page of each of key_rows and value_rows
        (sequences, in order). Returns the host columns (key, value) and, from one asynchronous copy, the device
        tensors k_rows, k_ids, k_cols, v_rows, v_ids, v_cols."""
        key_ids = self.key_pool.allocate(len(key_rows)) if len(key_rows) else []
        value_ids = self.value_pool.allocate(len(value_rows)) if len(value_rows) else []
        key_cols, value_cols = self.key_table.slots(key_rows), self.value_table.slots(value_rows)
        return key_cols, value_cols, self.to_device(key_rows, key_ids, key_cols, value_rows, value_ids, value_cols)

    def _fused_flush(self) -> bool:
        """Whether a decode step's full buffers go through the fused kernels (kernels/flush.py): flush="fused" and
        channels the kernel can choose itself, by magnitude (or all or none boosted). Random and query-aware
        selection, and subclasses with their own _choose_boost (backend.insights), keep the torch path."""
        # "auto": fused on a GPU, where it makes a batch-192 page-boundary step 32 instead of 50 ms at the same
        # decode speed (BENCHMARKS.md section 2), unless use_triton=False asks for the PyTorch path; torch on a CPU,
        # where Triton would run interpreted
        fused = self.flush == "fused" or (self.flush == "auto" and self.k_fp.is_cuda and self._triton())
        return (fused and (self.config.selection == "magnitude" or self.n_boost in (0, self.head_dim))
                and type(self)._choose_boost is KittyLayer._choose_boost)

    def _flush_in_kernels(self, key_rows: np.ndarray, value_rows: np.ndarray) -> None:
        """_quantize_full_buffers in one launch per kind: each kernel reads the due rows' pages from k_fp / v_fp, writes
        them into the pool, enters them in the table (device side) and shifts the buffer; the host side of the
        bookkeeping (pool free list, table counts) is the torch path's. Triton even when use_triton is False: on a
        CPU under the interpreter (kernels/__init__.py)."""
        cfg = self.config
        s, g, wait = cfg.sink, cfg.page_size, self.flush_spread - 1
        _, _, (k_rows, k_ids, k_cols, v_rows, v_ids, v_cols) = self._place_pages(key_rows, value_rows)
        if len(key_rows):
            flush.flush_key_pages(self.k_fp, k_rows, k_ids, k_cols, self.key_pool.tensors, self.key_table.ids,
                                  self.key_table.device_counts, s, g, self.n_boost, wait, self.record_magnitudes)
            self.key_table.count(key_rows)
        if len(value_rows):
            flush.flush_value_pages(self.v_fp, v_rows, v_ids, v_cols, self.value_pool.tensors, self.value_table.ids,
                                    self.value_table.device_counts, s, g, cfg.v_bits, cfg.local_window + wait)
            self.value_table.count(value_rows)

    def _choose_boost(self, key_x: torch.Tensor, rows: np.ndarray, cols: np.ndarray,
                      energy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Boosted channels (N, H, NB) and magnitudes (N, H, D) of new key pages `key_x`, page cols[i] of sequence
        rows[i]; `energy`: the queries' q_c^2 sums for query-aware selection. One method, so that a study can try
        another policy in a subclass (backend.insights: a mask frozen after the first page)."""
        return quantize.choose_boost(key_x, self.n_boost, self.config.selection, self._generator(), energy,
                                     self._triton())

    def _generator(self) -> torch.Generator | None:
        """Random channel selection draws from a per-layer generator seeded by the config: reproducible runs."""
        if self.config.selection != "random":
            return None
        if not hasattr(self, "_rng"):
            self._rng = torch.Generator().manual_seed(self.config.seed * 1009 + self.layer_idx)
        return self._rng

    # ------------------------------------------------------------------------------------------ accounting
    def reserved_bytes(self) -> int:
        """Bytes this layer has allocated: full-precision buffers at their capacity, page pools (free pages too),
        page tables (diagnostics excluded)."""
        if not self.is_initialized:
            return 0
        fp = sum(t.numel() * t.element_size() for t in (self.k_fp, self.v_fp))
        return fp + self.key_pool.nbytes + self.value_pool.nbytes + self.key_table.nbytes + self.value_table.nbytes

    def used_bytes(self) -> tuple[int, int]:
        """(key, value) bytes the stored tokens occupy, summed over the sequences: their pages (planes, metadata, a
        page-table entry each) and their tokens in the full-precision buffers at 16 bits (backend/memory.py says
        the same by arithmetic)."""
        if not self.is_initialized:
            return 0, 0
        g, row = self.config.page_size, self.heads * self.head_dim * FP_BYTES
        kp, vp = self.key_table.counts, self.value_table.counts
        key_page = key_page_bytes(self.heads, self.head_dim, g, self.n_boost) + TABLE_ENTRY_BYTES
        value_page = value_page_bytes(self.heads, self.head_dim, g, self.config.v_bits) + TABLE_ENTRY_BYTES
        keys = int((self.lengths - kp * g).sum()) * row + int(kp.sum()) * key_page
        values = int((self.lengths - vp * g).sum()) * row + int(vp.sum()) * value_page
        return keys, values

    def boost_record(self, seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `seq`'s key pages in order: boost masks (pages, H, D) bool and magnitudes (pages, H, D)."""
        ids = self.key_table.pages_of(seq)
        if not ids:
            empty = torch.zeros((0, self.heads, self.head_dim))
            return empty.bool(), empty
        index = torch.tensor(ids, device=self.device)
        mask = boost_mask(self.key_pool.tensors["ch"][index], self.head_dim)
        if self.record_magnitudes:
            magnitude = self.key_pool.tensors["magnitude"][index].float()
        else:
            magnitude = torch.full(mask.shape, float("nan"))
        return mask.cpu(), magnitude.cpu()


def prompt_lengths(attention_mask: torch.Tensor | None, width: int, batch: int) -> list[int]:
    """Real tokens per sequence of a left-padded prompt, read from the last query row of the 4D mask."""
    if attention_mask is None:
        return [width] * batch
    last = attention_mask[:, 0, -1, -width:]
    valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    valid = valid.expand(batch, -1)
    counts = valid.sum(dim=1)
    suffix = torch.arange(width, device=valid.device)[None, :] >= (width - counts)[:, None]
    if not torch.equal(valid, suffix):
        raise ValueError("KittyCache needs left padding (padding_side='left'): the prompt mask has holes")
    return counts.tolist()


# ---------------------------------------------------------------------------------------------- the Cache
@dataclass
class LayerStats:
    index: int
    kind: str                              # "kitty" (the method's layout) or "fp16-sliding" (left at full precision)
    used_bytes: int                        # what its stored tokens occupy (see CacheStats)
    reserved_bytes: int                    # what it has allocated
    key_pages: list[int]                   # per sequence
    value_pages: list[int]
    boost_masks: list[torch.Tensor]        # per sequence: (key pages, H, D) bool, True = channel stored at 4 bits
    magnitudes: list[torch.Tensor]         # per sequence: (key pages, H, D) mean |k| that chose the mask


@dataclass
class CacheStats:
    """What a cache holds. `bytes_used` counts what the stored tokens occupy (pages, full-precision buffers at
    16 bits, metadata, page-table entries); `bytes_reserved` what is allocated (buffer capacity, free pages):
    a short chat reserves a whole page's buffer it has not filled yet. Ratios and bits use the used bytes."""

    method: str
    config: dict
    batch_size: int
    tokens: list[int]                      # tokens stored per sequence (padding is never stored)
    bytes_used: int
    bytes_reserved: int
    fp16_bytes: int                        # the same tokens' keys and values at 16 bits
    key_bytes: int                         # used, keys
    value_bytes: int                       # used, values
    key_bits: float                        # bits per stored key element, buffers and metadata included
    value_bits: float
    key_pages: int
    value_pages: int
    layers: list[LayerStats] = field(repr=False)

    @property
    def compression(self) -> float:
        """FP16 bytes over used bytes: 1.0 for the fp16 preset, about 8 for long Kitty caches."""
        return self.fp16_bytes / self.bytes_used if self.bytes_used else 0.0

    @property
    def kv_ratio(self) -> float:
        """Used bytes over FP16 bytes (the inverse of compression): what a page shows as "x FP16"."""
        return self.bytes_used / self.fp16_bytes if self.fp16_bytes else 0.0

    def summary(self) -> dict:
        """Scalars only: what a table row or a log line shows."""
        keys = ("method", "batch_size", "tokens", "bytes_used", "bytes_reserved", "fp16_bytes", "key_bits",
                "value_bits", "key_pages", "value_pages")
        return {**{k: getattr(self, k) for k in keys}, "compression": self.compression, "kv_ratio": self.kv_ratio,
                "fp16_layers": sum(layer.kind != "kitty" for layer in self.layers)}


def attention_layer_types(model_config) -> list[str]:
    """'full_attention' or 'sliding_attention' per decoder layer; other kinds are refused with a clear error."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        types = ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    unsupported = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(f"KittyCache supports full and sliding-window attention layers, not {unsupported}")
    if "full_attention" not in types:
        raise ValueError("every layer of this model uses sliding-window attention: KittyCache quantizes full-"
                         "attention layers only, so it has nothing to do here")
    return list(types)


class KittyCache(Cache):
    """A KV cache for `model.generate(past_key_values=...)`: Kitty / KIVI / FP16 layers by one `CacheConfig`.

    Sliding-window layers (hybrid models) keep transformers' own full-precision sliding cache; stats() says so."""

    def __init__(self, config: CacheConfig, model_config, use_triton: bool | None = None,
                 record_magnitudes: bool = True, reserve_tokens: int = 0, flush_spread: int | str = "auto",
                 flush: str = "auto", decode_kernel: str = "auto"):
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        layers, shared_indices = [], {}
        for i, kind in enumerate(attention_layer_types(model_config)):
            if kind == "full_attention":
                layers.append(KittyLayer(config, i, use_triton, record_magnitudes, reserve_tokens, flush_spread,
                                         flush, shared_indices, decode_kernel))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window))
        super().__init__(layers=layers)
        self.config = config

    def stats(self) -> CacheStats:
        kitty = [layer for layer in self.layers if isinstance(layer, KittyLayer) and layer.is_initialized]
        layer_stats, key_bytes, value_bytes, reserved, fp16, elements = [], 0, 0, 0, 0, 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KittyLayer):
                if not layer.is_initialized:
                    continue
                kb, vb = layer.used_bytes()
                held = layer.reserved_bytes()
                elems = int(sum(layer.lengths)) * layer.heads * layer.head_dim
                records = [layer.boost_record(b) for b in range(layer.batch)]
                layer_stats.append(LayerStats(i, "kitty", kb + vb, held, layer.key_table.counts.tolist(),
                                              layer.value_table.counts.tolist(), [m for m, _ in records],
                                              [g for _, g in records]))
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                kb = layer.keys.numel() * layer.keys.element_size()
                vb = layer.values.numel() * layer.values.element_size()
                held, elems = kb + vb, layer.keys.numel()
                layer_stats.append(LayerStats(i, "fp16-sliding", kb + vb, held, [], [], [], []))
            else:
                continue
            key_bytes, value_bytes, reserved = key_bytes + kb, value_bytes + vb, reserved + held
            elements, fp16 = elements + elems, fp16 + 2 * FP_BYTES * elems
        first = kitty[0] if kitty else None
        return CacheStats(
            method=self.config.name, config=self.config.as_dict(),
            batch_size=first.batch if first else 0, tokens=first.lengths.tolist() if first else [],
            bytes_used=key_bytes + value_bytes, bytes_reserved=reserved, fp16_bytes=fp16, key_bytes=key_bytes,
            value_bytes=value_bytes, key_bits=8 * key_bytes / elements if elements else 0.0,
            value_bits=8 * value_bytes / elements if elements else 0.0,
            key_pages=sum(sum(s.key_pages) for s in layer_stats),
            value_pages=sum(sum(s.value_pages) for s in layer_stats), layers=layer_stats)
