"""What a cache holds, by arithmetic from the page layout: the bytes one sequence of L tokens uses in each method.

The same accounting as `KittyCache.stats()` counts on a live cache (pages in use, tokens in the full-precision
buffers at 16 bits, metadata, one page-table entry per page), so a projection to 8K, 32K or 128K tokens is exact
for the paper's schedule (flush_spread = 1). Tests hold the two against each other.
"""
from __future__ import annotations

from kernels.layout import key_page_bytes, value_page_bytes

from .methods import CacheConfig

FP_BYTES = 2                    # full-precision parts are stored at 16 bits
TABLE_ENTRY_BYTES = 4           # one int32 page id per page in a sequence's page table
PROJECTION_TOKENS = (8192, 32768, 131072)


def fp_tokens(config: CacheConfig, tokens: int) -> tuple[int, int]:
    """(key, value) tokens of one sequence kept at full precision: sink + Q-buffer (keys), sink + Q-buffer + local
    window (values), or all of them for 16-bit keys / values."""
    sink = min(tokens, config.sink)
    after = tokens - sink
    g = config.page_size
    keys = tokens if config.k_bits == 16 else sink + after % g
    values = tokens if config.v_bits == 16 else sink + after - max(0, after - config.local_window) // g * g
    return keys, values


def layer_bytes(config: CacheConfig, heads: int, head_dim: int, tokens: int) -> tuple[int, int]:
    """(key bytes, value bytes) one full-attention layer uses for one sequence of `tokens` tokens."""
    fp_k, fp_v = fp_tokens(config, tokens)
    row = heads * head_dim * FP_BYTES
    key_pages, value_pages = (tokens - fp_k) // config.page_size, (tokens - fp_v) // config.page_size
    nb = config.boosted_channels(head_dim)
    keys = fp_k * row + key_pages * (key_page_bytes(heads, head_dim, config.page_size, nb) + TABLE_ENTRY_BYTES)
    values = fp_v * row + value_pages * (value_page_bytes(heads, head_dim, config.page_size, config.v_bits)
                                         + TABLE_ENTRY_BYTES)
    return keys, values


def reserved_layer_bytes(config: CacheConfig, heads: int, head_dim: int, tokens: int, flush_spread: int = 1) -> int:
    """Bytes one full-attention layer allocates for one sequence when the cache reserves room for `tokens` up front
    (make_cache(..., reserve_tokens=tokens), as a long GPU run does): the full-precision buffers at their capacity
    (sink, Q-buffer and value window whether filled or not, room for flush_spread - 1 waiting tokens), page storage
    and page-table columns for every page the tokens fill, the table's page count. More than layer_bytes (what the
    stored tokens occupy); what a batch must fit into memory."""
    s, g, wait = config.sink, config.page_size, flush_spread - 1
    row = heads * head_dim * FP_BYTES
    pages = -(-max(0, tokens - s) // g)
    nb = config.boosted_channels(head_dim)
    total = 0
    for bits, window, page_bytes in ((config.k_bits, 0, key_page_bytes(heads, head_dim, g, nb)),
                                     (config.v_bits, config.local_window,
                                      value_page_bytes(heads, head_dim, g, config.v_bits))):
        if bits == 16:                              # a 16-bit side keeps every token in its buffer
            total += tokens * row + 4
        else:
            total += (s + window + g + wait) * row + pages * (page_bytes + TABLE_ENTRY_BYTES) + 4
    return total


def sequence_bytes(config: CacheConfig, model_config, tokens: int, sliding_elem_bytes: int = 2,
                   reserved: bool = False, flush_spread: int = 1) -> int:
    """Bytes the whole cache uses for one sequence of `tokens` tokens: every full-attention layer in the method's
    layout, sliding-window layers (hybrid models) at full precision over their window. reserved: what the cache
    allocates when it reserves room for the tokens up front (reserved_layer_bytes) instead."""
    from .cache import attention_layer_types       # the cache module imports this one
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    total = 0
    for kind in attention_layer_types(model_config):
        if kind == "full_attention":
            total += reserved_layer_bytes(config, heads, head_dim, tokens, flush_spread) if reserved \
                else sum(layer_bytes(config, heads, head_dim, tokens))
        else:
            total += 2 * min(tokens, text.sliding_window) * heads * head_dim * sliding_elem_bytes
    return total


def fp16_sequence_bytes(model_config, tokens: int) -> int:
    """The same tokens' keys and values at 16 bits in every layer: what each ratio is measured against."""
    return sequence_bytes(CacheConfig("fp16", k_bits=16, v_bits=16, sink=0), model_config, tokens)


def projection(config: CacheConfig, model_config, lengths=PROJECTION_TOKENS) -> tuple[tuple[int, int, int], ...]:
    """(tokens, bytes used, FP16 bytes) of one sequence at each length: what the cache would hold."""
    return tuple((n, sequence_bytes(config, model_config, n), fp16_sequence_bytes(model_config, n)) for n in lengths)
