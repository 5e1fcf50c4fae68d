"""Compact binary encodings for per-channel page statistics.

A page stat row exists per (layer, head, page), so there can be tens of
thousands per run; packed bits and raw float32 keep them ~20x smaller than JSON.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence


def pack_mask(mask: Sequence[bool]) -> bytes:
    """Pack flags LSB-first: channel i is bit (i % 8) of byte (i // 8)."""
    packed = bytearray((len(mask) + 7) // 8)
    for i, flag in enumerate(mask):
        if flag:
            packed[i >> 3] |= 1 << (i & 7)
    return bytes(packed)


def unpack_mask(packed: bytes, length: int) -> list[bool]:
    """Inverse of pack_mask; `length` is needed because the last byte is padded."""
    return [bool(packed[i >> 3] >> (i & 7) & 1) for i in range(length)]


def pack_floats(values: Sequence[float]) -> bytes:
    """float32 little-endian, independent of the host's byte order."""
    return struct.pack(f"<{len(values)}f", *values)


def unpack_floats(packed: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(packed) // 4}f", packed))
