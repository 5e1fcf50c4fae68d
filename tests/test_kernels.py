"""Every Triton kernel against its PyTorch reference on random data (interpreted on a CPU, compiled on a GPU):
packing bit for bit, dequantization and attention within float tolerance; head_dim 64 and 128, GQA 1/3/4/8,
odd lengths, batches of different lengths."""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE
from paged_factory import random_paged_kv

from backend.cache import KittyLayer
from backend.methods import method_config
from kernels.decode_attention import (FOLDED_KERNEL, GLUON_KERNELS, GLUON_MAXNREG, GLUON_MAXNREG_FEW, KERNELS,
                                      ROWS_KERNEL, ROWS_MIN_GBS, DecodeWorkspace, balanced_splits, bandwidth_gbs,
                                      check_kernel, decode_attention, decode_attention_ref, decode_launches,
                                      default_splits, device_memory_gbs, folds_max, gather_kv, gluon_maxnreg,
                                      is_gluon, kernel_parts, merge_blocks, merge_splits, multiprocessors,
                                      reads_rows, split_count)
from kernels.decode_rest import (REST_LOOP_PAGES, rest_blocks, rest_blocks_per_program, rest_maxnreg, rest_parts,
                                 rest_warps, takes_fields)
from kernels.dequantize import (dequantize_keys_ref, dequantize_pages_into, dequantize_pages_into_ref,
                                dequantize_values_ref)
from kernels.layout import (SWAP, boost_mask, key_chunks, key_offsets, key_plane_shape, key_rows, key_tile,
                            pack_quarters, store_key_tile, store_value_tile, unpack_quarters, value_chunks,
                            value_offsets, value_plane_shape, value_rows, value_tile)
from kernels.quantize import (channel_error, channel_error_ref, choose_boost, quantize_keys, quantize_keys_ref,
                              quantize_values, quantize_values_ref)
from kernels.unpack import MAGIC, field_asm, field_weights, unpack_asm

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def random_keys(n, h, g, d, dtype, seed):
    """Keys with loud and quiet channels, one constant channel (scale 0) and one tiny-range channel."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, g, d, generator=gen) * (torch.rand(d, generator=gen) * 6 + 0.1) + torch.randn(d, generator=gen)
    x[..., 3] = 1.5
    x[..., 5] = 0.25 + 1e-6 * torch.randn(n, h, g, generator=gen)
    return x.to(dtype).to(DEVICE)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def compile_on_cpu(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python from the repository root with TRITON_INTERPRET=0, so that it can compile kernels
    for a CUDA target without a GPU (in this process importing kernels/ turned the interpreter on); it must exit 0."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_pack_roundtrip():
    q = torch.randint(0, 4, (3, 64, 5))
    packed = pack_quarters(q, dim=1)
    assert packed.shape == (3, 16, 5) and packed.dtype == torch.uint8
    assert torch.equal(unpack_quarters(packed, dim=1), q)
    row = pack_quarters(torch.tensor([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]), dim=0)
    assert row.tolist() == [1 | 2 << 2 | 3 << 4, 0, 0, 0]         # element j + i*n/4 in byte j at bits 2i


def test_planes_are_stored_chunk_by_chunk():
    """layout.py's storage order, which the Gluon kernel copies into shared memory as it is: a key plane's byte [c, j,
    4a + SWAP[b]] is row j's channel 32c + 4a + b (a plane narrower than 32, or not a multiple of it, is one chunk),
    a value plane's byte [q, c, 4a + SWAP[b]] is channel byte c of token q * G/4 + 4a + b (SWAP: bytes 1 and 2 of
    every 4 traded); key_rows / value_rows undo it, and the Triton kernels' offsets address the same bytes."""
    assert SWAP == (0, 2, 1, 3)
    rows = torch.randint(0, 256, (2, 3, 32, 128), dtype=torch.uint8)                   # (N, H, G/4, D)
    stored = key_chunks(rows)
    assert stored.shape == (2, 3, *key_plane_shape(3, 128, 128)[1:]) == (2, 3, 4, 32, 32)
    assert stored[1, 2, 3, 5, 7] == rows[1, 2, 5, 3 * 32 + 7] and torch.equal(key_rows(stored), rows)
    assert stored[1, 2, 3, 5, 5] == rows[1, 2, 5, 3 * 32 + 6] and stored[1, 2, 3, 5, 6] == rows[1, 2, 5, 3 * 32 + 5]
    for narrow in (16, 48):
        assert key_chunks(rows[..., :narrow]).shape == (2, 3, 1, 32, narrow) == (2, 3, *key_plane_shape(3, 128,
                                                                                                       narrow)[1:])
    values = torch.randint(0, 256, (2, 3, 32, 128), dtype=torch.uint8)                 # (N, H, D/4, G)
    stored = value_chunks(values)
    assert stored.shape == (2, 3, *value_plane_shape(3, 128, 128)[1:]) == (2, 3, 4, 32, 32)
    assert stored[1, 2, 3, 5, 7] == values[1, 2, 5, 3 * 32 + 7] and torch.equal(value_rows(stored), values)
    assert stored[1, 2, 3, 5, 1] == values[1, 2, 5, 3 * 32 + 2] and stored[1, 2, 3, 5, 2] == values[1, 2, 5, 3 * 32 + 1]
    # the Triton kernels' tiles: read byte by byte at key_offsets / value_offsets, and as whole words put in order
    # (key_tile, value_tile); written back as whole words (store_key_tile, store_value_tile)
    key_plane = key_chunks(rows)[1, 2].contiguous().to(DEVICE)
    value_plane = value_chunks(values)[1, 2].contiguous().to(DEVICE)
    for words in (False, True):
        key_tile_ = torch.empty(32, 128, dtype=torch.uint8, device=DEVICE)
        value_tile_ = torch.empty(128, 32, dtype=torch.uint8, device=DEVICE)
        key_copy, value_copy = torch.zeros_like(key_plane), torch.zeros_like(value_plane)
        _planes_kernel[(1,)](key_plane, value_plane, key_tile_, value_tile_, key_copy, value_copy, WORDS=words)
        assert torch.equal(key_tile_.cpu(), rows[1, 2]) and torch.equal(value_tile_.cpu(), values[1, 2].T), words
        assert torch.equal(key_copy, key_plane) and torch.equal(value_copy, value_plane), words


@triton.jit
def _planes_kernel(key_plane, value_plane, key_out, value_out, key_copy, value_copy, WORDS: tl.constexpr):
    """A (G/4 = 32, D = 128) key plane and a (D/4 = 32, G = 128) value plane read as the Triton kernels read them:
    the key tile (rows, channels) and the value tile (tokens, channel bytes) into key_out / value_out, and both
    written again into key_copy / value_copy."""
    j = tl.arange(0, 32)
    d = tl.arange(0, 128)
    key_mask = (j[:, None] < 32) & (d[None, :] < 128)
    value_mask = (d[:, None] < 128) & (j[None, :] < 32)
    if WORDS:
        keys = key_tile(key_plane, j, d, key_mask, 32, 128)
        values = value_tile(value_plane, j[None, :], d[:, None], value_mask, 128, 32, 0)
    else:
        keys = tl.load(key_plane + key_offsets(j, d, 32, 128))
        values = tl.load(value_plane + value_offsets(j[None, :], d[:, None], 128, 32))
    tl.store(key_out + j[:, None] * 128 + d[None, :], keys)
    tl.store(value_out + d[:, None] * 32 + j[None, :], values)
    store_key_tile(key_copy, j, d, keys, key_mask, 32, 128)
    store_value_tile(value_copy, j[None, :], d[:, None], values, value_mask, 128, 32, 0)


@pytest.mark.parametrize("g,d", [(128, 64), (64, 128), (36, 64)])
@pytest.mark.parametrize("boost", ["none", "kitty", "kitty-pro", "k4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_keys_bit_exact(g, d, boost, dtype):
    nb = {"none": 0, "kitty": math.ceil(d / 8), "kitty-pro": d // 4, "k4": d}[boost]
    x = random_keys(3, 2, g, d, dtype, seed=g + d + nb)
    ch, _ = choose_boost(x, nb)
    ref = quantize_keys_ref(x, ch, nb)
    out = quantize_keys(x, ch, nb)
    for name, a, b in zip(("low", "high", "scale", "zero"), out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name} differs in {(a != b).sum().item()} places"


@pytest.mark.parametrize("g,d", [(128, 64), (64, 128), (36, 64)])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_values_bit_exact(g, d, bits, dtype):
    x = random_keys(2, 3, g, d, dtype, seed=bits * g + d).transpose(2, 3).contiguous().transpose(2, 3)
    ref = quantize_values_ref(x, bits)
    out = quantize_values(x, bits)
    for name, a, b in zip(("low", "high", "scale", "zero"), out, ref):
        assert a.shape == b.shape and torch.equal(a, b), name


def pages_into_both(kind: str, pool: dict, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool pages written into two ragged sequences' rows by the Triton kernel and by the reference: pages out of
    order, at odd starts, one sequence with two pages; (kernel's out, reference's out, the pages' token starts)."""
    n, heads = pool["low"].shape[:2]
    g = pool["scale"].shape[-1] if kind == "value" else 4 * pool["low"].shape[3]        # (n, H, chunks, G/4, C)
    d = pool["scale"].shape[-1] if kind == "key" else 4 * pool["low"].shape[3]          # (n, H, 4, D/4, G/4)
    ids = torch.tensor([n - 1, 0, n - 2], dtype=torch.int32, device=DEVICE)
    seqs = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([3, 1, 3 + g], dtype=torch.int32, device=DEVICE)
    outs = [torch.zeros(2, 2 * g + 5, heads, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    dequantize_pages_into(outs[0], kind, pool, ids, seqs, starts)
    dequantize_pages_into_ref(outs[1], kind, pool, ids, seqs, starts)
    return outs[0], outs[1], starts


@pytest.mark.parametrize("d,nb", [(64, 8), (128, 32), (64, 0), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_key_pages_into_matches_reference_and_input(d, nb, dtype):
    x = random_keys(3, 2, 128, d, dtype, seed=d + nb)
    ch, _ = choose_boost(x, nb)
    low, high, scale, zero = quantize_keys_ref(x, ch, nb)
    ref = dequantize_keys_ref(low, high, ch, scale, zero, dtype)
    out, want, starts = pages_into_both("key", dict(low=low, high=high, ch=ch, scale=scale, zero=zero), dtype)
    assert rel_err(out, want) < 1e-2 and (out.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
    assert torch.equal(want[1, 3:131], ref[2].transpose(0, 1)) and want[1, :3].eq(0).all()   # page 2 at its rows
    # Round trip: every element within half a step of its channel's grid (plus FP16 rounding of scale / zero)
    step = scale.float().unsqueeze(2)                                         # (N, H, 1, D)
    err = (ref.float() - x.float()).abs()
    assert (err <= step / 2 + 1e-2 * (x.float().abs() + ref.float().abs()) + 1e-3).all()  # + bf16 rounding
    boosted = boost_mask(ch, d).unsqueeze(2)
    if 0 < nb < d:  # 4-bit channels land on a grid 5x finer than 2-bit ones with the same range
        assert err[boosted.expand_as(err)].mean() < err[~boosted.expand_as(err)].mean()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_dequantize_value_pages_into_matches_reference(d, bits):
    x = random_keys(3, 2, 64, d, torch.float16, seed=bits + d)
    low, high, scale, zero = quantize_values_ref(x, bits)
    ref = dequantize_values_ref(low, high, scale, zero, torch.float16)
    out, want, _ = pages_into_both("value", dict(low=low, high=high, scale=scale, zero=zero), torch.float16)
    assert rel_err(out, want) < 1e-3 and torch.equal(want[0, 1:65], ref[0].transpose(0, 1))
    assert ((ref.float() - x.float()).abs() <= scale.float().unsqueeze(-1) / 2 + 2e-3 * x.float().abs() + 1e-3).all()


def test_choose_boost_picks_loudest_channels_and_random_is_reproducible():
    x = torch.randn(2, 3, 128, 64)
    x[..., [7, 9, 40]] *= 50
    ch, mags = choose_boost(x, 8)
    assert ch.shape == (2, 3, 8) and ch.dtype == torch.uint8
    assert (ch[..., 1:] > ch[..., :-1]).all()                                 # ascending: row r of the high plane
    assert boost_mask(ch, 64)[..., [7, 9, 40]].all()
    assert torch.equal(ch[0, 0].long(), mags[0, 0].topk(8).indices.sort().values)
    assert torch.allclose(mags, x.abs().mean(2))
    r1, _ = choose_boost(x, 8, "random", torch.Generator().manual_seed(3))
    r2, _ = choose_boost(x, 8, "random", torch.Generator().manual_seed(3))
    r3, _ = choose_boost(x, 8, "random", torch.Generator().manual_seed(4))
    assert torch.equal(r1, r2) and not torch.equal(r1, r3) and boost_mask(r1, 64).sum(-1).eq(8).all()
    all4, _ = choose_boost(x, 64)
    assert torch.equal(all4[0, 0].long(), torch.arange(64))
    assert choose_boost(x, 0)[0].shape == (2, 3, 0)


def _bf16_or_fp16(bits: int, dtype: torch.dtype) -> float:
    return torch.tensor([bits - (bits >> 15 << 16)], dtype=torch.int16).view(dtype).float().item()


def run_unpack_ptx(asm: str, inputs: dict, dtype: torch.dtype, outputs: int = 8) -> list[float]:
    """Execute the PTX of unpack_asm or field_asm on its input registers (inputs: {"$8": a 32-bit word, ...}),
    instruction by instruction (the subset they use: mov, prmt, shr, lop3 0xea, fma.rn on 16-bit pairs), and return
    $0..$(outputs - 1) as 2 * outputs values (low half first)."""
    regs = dict(inputs)
    value = lambda tok: regs[tok] if tok in regs else int(tok, 0)                   # noqa: E731
    for ins in (s.strip() for s in asm.strip("{} ").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "prmt.b32":
            pool = value(src[0]) | value(src[1]) << 32
            sel = value(src[2])
            regs[dst] = sum(((pool >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))
        elif op == "shr.b32":
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "lop3.b32":
            assert src[3] == "0xea"                                                 # (a & b) | c
            regs[dst] = (value(src[0]) & value(src[1])) | value(src[2])
        elif op.startswith("fma.rn."):
            a, b, c = (value(s) for s in src)
            halves = []
            for k in (0, 16):
                x, y, z = (_bf16_or_fp16((v >> k) & 0xFFFF, dtype) for v in (a, b, c))
                r = torch.tensor([x * y + z], dtype=torch.float64).to(dtype)     # exact here: one rounding
                halves.append((r.view(torch.int16).item() & 0xFFFF) << k)
            regs[dst] = halves[0] | halves[1]
        else:
            raise AssertionError(f"unexpected instruction {ins}")
    out = []
    for k in range(outputs):
        out += [_bf16_or_fp16(regs[f"${k}"] & 0xFFFF, dtype), _bf16_or_fp16(regs[f"${k}"] >> 16, dtype)]
    return out


@pytest.mark.parametrize("dtype,offset", [(torch.bfloat16, True), (torch.float16, False)])   # what the kernel runs
def test_unpack_ptx_turns_every_byte_into_its_four_codes(dtype, offset):
    """The GPU path's bit trick (its exact PTX text, executed here): a word of bytes b0..b3 gives, for quarter
    i, the pairs (b0, b1) in $2i and (b2, b3) in $2i+1 of field i, exactly, for all 256 values of every byte
    (offset=True: as M + w_i * field, the kernel's bf16 operands)."""
    asm = unpack_asm(dtype, offset)
    magic, weights = (MAGIC[dtype], field_weights(dtype)) if offset else (0.0, [1.0] * 4)
    gen = torch.Generator().manual_seed(0)
    words = [0, 0xFFFFFFFF, 0x1B1B1B1B] + torch.randint(0, 2 ** 32, (40,), generator=gen).tolist()
    words += [b | (255 - b) << 8 | ((b * 7) % 256) << 16 | ((b * 13 + 5) % 256) << 24 for b in range(256)]
    for word in words:
        got = run_unpack_ptx(asm, {"$8": word}, dtype)
        byte = [(word >> (8 * k)) & 0xFF for k in range(4)]
        want = []
        for i in range(4):
            fields = [magic + weights[i] * ((b >> (2 * i)) & 3) for b in byte]
            want += fields                                                          # b0, b1 | b2, b3
        assert got == [float(v) for v in want], hex(word)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_field_ptx_takes_one_field_of_every_byte(dtype):
    """decode_rest's _field on the GPU (field_asm's exact PTX text, executed here): a shift of 2i ($2; $3-$5 are
    Triton's copies) and a word of bytes b0..b3 ($6) give field i of (b0, b1) in $0 and of (b2, b3) in $1, exact
    codes 0..3, for all 256 values of every byte and each of the four fields."""
    asm = field_asm(dtype)
    gen = torch.Generator().manual_seed(1)
    words = [0, 0xFFFFFFFF, 0xE4E4E4E4] + torch.randint(0, 2 ** 32, (20,), generator=gen).tolist()
    words += [b | (255 - b) << 8 | ((b * 7) % 256) << 16 | ((b * 13 + 5) % 256) << 24 for b in range(256)]
    for i in range(4):
        for word in words:
            got = run_unpack_ptx(asm, {"$2": 2 * i, "$3": 2 * i, "$4": 2 * i, "$5": 2 * i, "$6": word}, dtype, 2)
            assert got == [float((word >> (8 * k + 2 * i)) & 3) for k in range(4)], (i, hex(word))


ATTENTION_CASES = [
    # lengths (odd, ragged), KV heads, head_dim, GQA group, k_bits, v_bits, sink, page, window, boosted, dtype
    ([300, 17, 201], 2, 64, 1, 2, 2, 32, 64, 64, 8, torch.float16),
    ([333, 129], 3, 64, 3, 2, 2, 32, 64, 64, 16, torch.float16),
    ([405], 2, 128, 4, 2, 2, 32, 128, 128, 16, torch.float16),
    ([77, 290], 1, 128, 8, 2, 2, 0, 64, 64, 0, torch.bfloat16),
    ([260, 263], 2, 64, 4, 4, 4, 0, 64, 32, 64, torch.float16),
    ([211], 2, 64, 3, 2, 4, 16, 36, 40, 8, torch.bfloat16),
    ([150, 3], 2, 128, 1, 4, 2, 32, 64, 64, 128, torch.float16),
    ([99, 180], 2, 64, 4, 16, 16, 0, 64, 64, 0, torch.float16),
    ([199], 2, 64, 4, 2, 16, 32, 64, 64, 8, torch.float16),
    ([31], 2, 64, 3, 2, 2, 32, 64, 64, 8, torch.float16),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"L{c[0]}-h{c[1]}-d{c[2]}-g{c[3]}-k{c[4]}v{c[5]}")
def test_decode_attention_matches_reference(case):
    lengths, h, d, group, kb, vb, sink, page, window, nb, dtype = case
    kv, _, _ = random_paged_kv(lengths, heads=h, head_dim=d, sink=sink, page_size=page, window=window, k_bits=kb,
                               v_bits=vb, n_boost=nb, dtype=dtype, seed=sum(lengths), device=DEVICE)
    q = torch.randn(len(lengths), h * group, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ref = decode_attention_ref(q, kv, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    for splits in (1, 3, None):
        out = decode_attention(q, kv, d ** -0.5, num_splits=splits)
        assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
        assert rel_err(out, ref) < tol, f"splits={splits}: {rel_err(out, ref):.2e}"


REST_KEYS_CASES = [
    # lengths, KV heads, head_dim, GQA group, k_bits, v_bits, sink, page, window, boosted, dtype: pages of 128 or 256
    # tokens, whose remaining blocks (32 tokens) are in one token quarter (takes_fields); the longest sequence of each
    # has a key page or two whose values are still 16-bit, which the remaining blocks read
    ([405, 130], 2, 128, 4, 2, 2, 32, 128, 128, 32, torch.bfloat16),          # kitty-pro, Qwen3-8B's group
    ([333, 290], 3, 64, 3, 2, 2, 32, 128, 128, 16, torch.float16),
    ([420, 77], 1, 128, 8, 2, 2, 0, 128, 200, 0, torch.float16),               # kivi-k2v2, two window pages
    ([330], 2, 64, 1, 4, 4, 16, 256, 64, 64, torch.float16),                   # 4-bit keys, half-quarter blocks
]


@pytest.mark.parametrize("case", REST_KEYS_CASES, ids=lambda c: f"L{c[0]}-d{c[2]}-g{c[3]}-p{c[7]}-k{c[4]}")
def test_rest_keys_codes_match_reference(case):
    """decode_attention(rest_keys="codes"): the remaining blocks of a key page taking one 2-bit field of each byte
    as the product's operand with the page's scales on the queries and its zero term apart (decode_rest's KEYS;
    compiled, the fields by field_asm's PTX), one block a program and three: the reference's output."""
    lengths, h, d, group, kb, vb, sink, page, window, nb, dtype = case
    kv, _, _ = random_paged_kv(lengths, heads=h, head_dim=d, sink=sink, page_size=page, window=window, k_bits=kb,
                               v_bits=vb, n_boost=nb, dtype=dtype, seed=sum(lengths) + 7, device=DEVICE)
    assert takes_fields(page) and (kv.n_kpages > kv.n_vpages).any()         # the path under test runs
    q = torch.randn(len(lengths), h * group, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    ref = decode_attention_ref(q, kv, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    for blocks in (1, 3):
        out = decode_attention(q, kv, d ** -0.5, num_splits=2, rest_keys="codes", rest_blocks=blocks)
        assert torch.isfinite(out).all() and rel_err(out, ref) < tol, f"{blocks}: {rel_err(out, ref):.2e}"


def test_rest_keys_codes_only_where_blocks_are_in_one_token_quarter():
    """A block's codes are one 2-bit field of every byte only where its 32 tokens are in one token quarter of their
    page (pages of 128 tokens or more): elsewhere "codes" leaves the kernel as "elements" makes it (its KEYS constant
    0); a name that is not a way gets a ValueError naming them."""
    from kernels.decode_attention import dot_dtype, precision
    from kernels.decode_rest import rest_kernel_arguments
    assert [takes_fields(g) for g in (16, 32, 64, 128, 256)] == [False, False, False, True, True]
    for page, index in ((64, 0), (128, 1)):
        kv, _, _ = random_paged_kv([300], heads=1, head_dim=64, page_size=page, window=page, n_boost=8)
        q = torch.zeros(1, 2, 64, dtype=torch.float16)
        parts = (torch.zeros(1, 2, 9, 64), torch.zeros(1, 2, 9), torch.zeros(1, 2, 9))
        _, constants = rest_kernel_arguments(q, kv, 1.0, parts, 0, dot_dtype(q.dtype), precision(tl.float16),
                                             keys="codes")
        assert constants["KEYS"] == index, page
    with pytest.raises(ValueError, match="auto, elements, codes"):
        decode_attention(q, kv, 64 ** -0.5, rest_keys="bits")


GLUON_CASES = [
    # lengths, KV heads, head_dim, GQA group, k_bits, v_bits, sink, page, window, boosted, dtype: shapes the Gluon
    # kernel takes (pages of 64 or 128 tokens, head_dim 64 or 128, boosted channels a multiple of 16)
    ([4100, 300, 1], 2, 128, 4, 2, 2, 32, 128, 128, 32, torch.bfloat16),       # kitty-pro, Qwen3-8B's group
    ([1000, 517], 3, 128, 3, 2, 2, 32, 128, 128, 16, torch.bfloat16),          # kitty
    ([700, 333], 2, 64, 8, 2, 2, 0, 64, 64, 0, torch.bfloat16),                # kivi-k2v2
    ([900], 2, 64, 1, 4, 4, 16, 64, 64, 64, torch.bfloat16),                   # kivi-k4v4
    ([650, 129], 2, 128, 4, 2, 4, 32, 128, 128, 32, torch.float16),
    ([1300], 1, 64, 3, 4, 2, 32, 64, 64, 64, torch.float16),
    # head_dim 128 and pages of 128 (the default model's) at GQA ratios 8 and 1
    ([2000, 130], 2, 128, 8, 2, 2, 32, 128, 128, 32, torch.bfloat16),
    ([777], 3, 128, 1, 2, 2, 0, 128, 128, 0, torch.float16),                  # kivi-k2v2
    # head_dim 64 at GQA ratio 3 with pages of 128 and one chunk of boosted channels (the 8-bit products' shapes)
    ([1100, 260, 129], 2, 64, 3, 2, 2, 32, 128, 128, 32, torch.float16),
    # kitty at head_dim 128 with pages of 64: a 256-byte plane of 16 boosted channels, under a warp's 512-byte copy
    ([600, 170], 2, 128, 4, 2, 2, 32, 64, 64, 16, torch.bfloat16),
]


# The Gluon kernels the GPU tests run: each base kernel, and each with the experiments it takes
# (decode_attention.GLUON_EXPERIMENTS; fold-max only with zq-ahead, and neither it nor q-rows on the 8-bit key
# products)
GLUON_TESTED = (*GLUON_KERNELS, "gluon-tma+zq-ahead", "gluon-tma+zq-ahead+fold-max", "gluon+zq-ahead+fold-max",
                "gluon-tma-i8k+zq-ahead", "gluon-tma-i8+zq-ahead", "gluon-tma+zq-ahead+fold-max+q-rows",
                "gluon+q-rows")


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="Gluon kernels need a GPU")
@pytest.mark.parametrize("kernel", GLUON_TESTED)
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: f"L{c[0]}-h{c[1]}-d{c[2]}-g{c[3]}-k{c[4]}v{c[5]}-{c[9]}")
def test_gluon_decode_attention_matches_reference(case, kernel):
    """The Gluon kernel with one split (programs of many slots: every buffer refilled many times) at the compiler's
    registers, three at a cap of 168, and the default split and cap (gluon_maxnreg: 192 or 168), against the
    reference and the Triton kernel; the partials and the output poisoned first, so that an unwritten element
    fails. Its arithmetic is not the Triton kernel's (fp16 operands for both query dtypes, matrix products for
    the zero terms and the sums of p): it must be about as close to the reference as the Triton kernel (within
    25 %), or within a quarter of the tolerance. Measured on the H200: 2-5x closer with bf16 queries (the Triton
    kernel's operands are bf16), 0.8-1.08x the Triton kernel's error with fp16 ones. The TMA copies
    (kernel="gluon-tma") move the same bytes: the same bar, on Hopper."""
    from kernels import decode_gluon
    lengths, h, d, group, kb, vb, sink, page, window, nb, dtype = case
    options = decode_gluon.kernel_options(kernel)
    if options["use_tma"] and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("decode_gluon.supports_tma takes Hopper GPUs only (the only kind the TMA copies ran on)")
    kv, _, _ = random_paged_kv(lengths, heads=h, head_dim=d, sink=sink, page_size=page, window=window, k_bits=kb,
                               v_bits=vb, n_boost=nb, dtype=dtype, seed=sum(lengths), device=DEVICE)
    q = torch.randn(len(lengths), h * group, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    if not decode_gluon.takes_shapes(kernel, q, kv):
        pytest.skip("the 8-bit key products take boosted channels in one chunk of 32 or none, the value products "
                    "pages of 128 and 2-bit values (decode_gluon.takes_shapes)")
    assert decode_gluon.supports_kernel(kernel, q, kv)
    ref = decode_attention_ref(q, kv, d ** -0.5)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    if options["i8"]:
        check_i8_kernel(q, kv, kernel, ref, tol)
        return
    for splits, maxnreg in ((1, 255), (3, 168), (None, None)):          # None: the defaults
        workspace = DecodeWorkspace()
        poisoned = workspace.get(q, (splits or split_count(q, kv, kernel, GLUON_MAXNREG)) + rest_parts(kv))
        for buffer in poisoned:
            buffer.fill_(float("nan"))
        out = decode_attention(q, kv, d ** -0.5, num_splits=splits, kernel=kernel, maxnreg=maxnreg,
                               workspace=workspace)
        assert workspace.buffers is poisoned, "the call took other buffers than the poisoned ones"
        assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
        assert rel_err(out, ref) < tol, f"splits={splits}: {rel_err(out, ref):.2e}"
        triton_out = decode_attention(q, kv, d ** -0.5, num_splits=splits, kernel="triton")
        assert rel_err(out, ref) <= max(1.25 * rel_err(triton_out, ref), tol / 4), \
            f"splits={splits}: {rel_err(out, ref):.2e} from the reference, Triton {rel_err(triton_out, ref):.2e}"


def test_gluon_kernels_compile_for_every_gpu_test_shape():
    """Without a GPU: every kernel the GPU tests run (GLUON_TESTED) compiles for sm_90 at the default cap at every
    shape they run it at (GLUON_CASES, where decode_gluon.takes_shapes takes it; the GPU test skips the others), so
    that a kernel changed in a session without a GPU is known to build before device time is spent on it (session 34
    ran this as a script first: 200 compilations at caps 168 and 255, all built)."""
    code = textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, "tests")
        from paged_factory import random_paged_kv
        from kernels.decode_gluon import kernel_options, takes_shapes
        from kernels.sass_profile import compile_gluon_launch
        built, failed = 0, []
        for lengths, h, d, group, kb, vb, sink, page, window, nb, dtype in {GLUON_CASES!r}:
            kv, _, _ = random_paged_kv(lengths, heads=h, head_dim=d, sink=sink, page_size=page, window=window,
                                       k_bits=kb, v_bits=vb, n_boost=nb, dtype=dtype, seed=sum(lengths))
            q = torch.zeros(len(lengths), h * group, d, dtype=dtype)
            for kernel in {GLUON_TESTED!r}:
                if takes_shapes(kernel, q, kv):
                    try:
                        compile_gluon_launch(q, kv, 3, maxnreg=168, **kernel_options(kernel))
                        built += 1
                    except Exception as error:
                        failed.append((lengths, kernel, repr(error)[:400]))
        print(built, failed)
    """)
    from kernels.decode_gluon import takes_shapes
    taken = 0
    for lengths, h, d, group, kb, vb, sink, page, window, nb, dtype in GLUON_CASES:
        kv, _, _ = random_paged_kv(lengths, heads=h, head_dim=d, sink=sink, page_size=page, window=window,
                                   k_bits=kb, v_bits=vb, n_boost=nb, dtype=dtype, seed=sum(lengths))
        q = torch.zeros(len(lengths), h * group, d, dtype=dtype)
        taken += sum(takes_shapes(kernel, q, kv) for kernel in GLUON_TESTED)
    run = compile_on_cpu(code, timeout=1800)
    built, failed = run.stdout.split(" ", 1)
    assert failed.strip() == "[]", failed
    # 11 kernels on 10 shapes less the 8-bit ones' declined shapes (4 each for the 2 i8k names, 6 each for the 2 i8
    # names): 90 since session 39 (70 since session 35)
    assert int(built) == taken >= 90, (built, taken)


def check_i8_kernel(q, kv, kernel, ref, tol):
    """An 8-bit kernel against its own arithmetic (kernels/i8_reference.py, one split): within the fp16 kernel's
    tolerance or a fifth of how far that arithmetic is from the exact reference, whichever is larger. On the H200
    (tree 2cc1138, the keys' scale by IEEE division as in the reference) the fp16 cases are 3-4 % of the rounding's
    own effect from it, the bf16 cases 9-12 %, most of that the outputs' bf16 rounding (BENCHMARKS.md section 1,
    session 21); before that division, two fp16 cases were 11 % and 14 %. With the default split, no further from
    the exact reference than that arithmetic is, plus the tolerance. The rounding is per head: queries whose heads
    differ 16x in size would overflow the 8-bit operands if a head took another's scale. A head of zero queries
    (operands under I8_AMAX_FLOOR) must decode to finite numbers."""
    from kernels import decode_gluon
    from kernels.i8_reference import decode_attention_i8_ref
    d = q.shape[-1]
    heads = 2.0 ** torch.linspace(-2, 2, q.shape[1], device=q.device)
    zeroed = q.clone()
    zeroed[0, 1] = 0.0                      # operands all under I8_AMAX_FLOOR: an fp16 scale of 65,024, not inf
    for queries in (q, (q.float() * heads[None, :, None]).to(q.dtype), zeroed):
        values = decode_gluon.kernel_options(kernel)["i8"] == 2
        expected = decode_attention_i8_ref(queries, kv, d ** -0.5, values=values)
        exact = ref if queries is q else decode_attention_ref(queries, kv, d ** -0.5)
        one = decode_attention(queries, kv, d ** -0.5, num_splits=1, kernel=kernel)
        assert rel_err(one, expected) < max(tol, 0.2 * rel_err(expected, exact)), \
            f"{rel_err(one, expected):.2e} from its arithmetic, which is {rel_err(expected, exact):.2e} from exact"
        out = decode_attention(queries, kv, d ** -0.5, kernel=kernel)
        assert torch.isfinite(out).all()
        assert rel_err(out, exact) < rel_err(expected, exact) * 1.25 + tol, \
            f"{rel_err(out, exact):.2e} from the reference, its arithmetic {rel_err(expected, exact):.2e}"


def test_i8_reference_takes_queries_of_zeros():
    """kernels/i8_reference.py on the CPU: a head whose queries times key scales all stay under 2^-9 (zeros, or a
    normal query times 1e-4) rounds them against 127 / 2^-9 = 65,024, which fp16 holds: its output is finite and
    about the exact one. (Against the floor of 2^-10 that scale was inf in fp16, and a query of zeros gave NaN.)"""
    from kernels.i8_reference import decode_attention_i8_ref
    kv, _, _ = random_paged_kv([600, 300], heads=2, head_dim=64, sink=32, page_size=128, window=128, n_boost=32,
                               dtype=torch.float32, seed=4)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5))
    q[0, 1] = 0.0
    q[1, 4] *= 1e-4
    ref = decode_attention_ref(q, kv, 64 ** -0.5)
    for values in (False, True):
        out = decode_attention_i8_ref(q, kv, 64 ** -0.5, values=values)
        assert torch.isfinite(out).all(), values
        for b, head in ((0, 1), (1, 4)):
            assert rel_err(out[b, head], ref[b, head]) < 0.02, (values, b, head, rel_err(out[b, head], ref[b, head]))


def test_i8_reference_rounds_the_operands_it_says():
    """kernels/i8_reference.py on the CPU: its 8-bit keys move the output off the exact reference by about what 7-bit
    query operands can (not zero, under 5 %), its 8-bit values further (still under 25 %)."""
    from kernels.i8_reference import decode_attention_i8_ref
    kv, _, _ = random_paged_kv([600, 300], heads=2, head_dim=64, sink=32, page_size=128, window=128, n_boost=32,
                               dtype=torch.float32, seed=4)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5))
    ref = decode_attention_ref(q, kv, 64 ** -0.5)
    keys = rel_err(decode_attention_i8_ref(q, kv, 64 ** -0.5, values=False), ref)
    both = rel_err(decode_attention_i8_ref(q, kv, 64 ** -0.5, values=True), ref)
    assert 1e-4 < keys < 0.05 and keys < both < 0.25, (keys, both)


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                    reason="warps a program only exist on a GPU (the interpreter runs none), and Gluon needs one")
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("rest_warps, rest_maxnreg", [(1, None), (2, None), (4, None), (2, 168), (2, 255)])
def test_remaining_blocks_warps(kernel, rest_warps, rest_maxnreg):
    """The remaining blocks' launch (decode_rest.py) with each warp count a program (the default here, 54 programs:
    4), and at the register caps bench tune --vary rest-pdl measures: the same output up to the order of float sums."""
    kv, _, _ = random_paged_kv([4100, 300, 1], heads=2, head_dim=128, sink=32, page_size=128, window=128, k_bits=2,
                               v_bits=2, n_boost=32, dtype=torch.bfloat16, seed=5, device=DEVICE)
    q = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    expected = decode_attention(q, kv, 128 ** -0.5, kernel=kernel)
    assert rel_err(expected, decode_attention_ref(q, kv, 128 ** -0.5)) < 1.5e-2
    out = decode_attention(q, kv, 128 ** -0.5, kernel=kernel, rest_warps=rest_warps, rest_maxnreg=rest_maxnreg)
    assert rel_err(out, expected) < 1e-3
    for blocks in (2, 9):                           # several blocks a program, as at larger batches by default
        out = decode_attention(q, kv, 128 ** -0.5, kernel=kernel, rest_warps=rest_warps, rest_maxnreg=rest_maxnreg,
                               rest_blocks=blocks)
        assert rel_err(out, expected) < 1e-3, f"{blocks} blocks a program: {rel_err(out, expected):.2e}"


@pytest.mark.parametrize("blocks", [1, 2, 4, 100])
def test_remaining_blocks_any_number_a_program(blocks):
    """The remaining blocks 1, 2 or 4 a program, or all of a sequence's in one (100), with a running softmax over
    them: the reference's output, the partials poisoned first (a program must write its partial even when every
    block it was given is past its sequence's end: the sequence of 17 tokens, shorter than the sink). The key pages
    have boosted channels, and the sequences of 300 and 201 tokens a key page whose values are still 16-bit."""
    kv, _, _ = random_paged_kv([300, 17, 201], heads=2, head_dim=64, sink=32, page_size=64, window=64, n_boost=8,
                               dtype=torch.float16, seed=518, device=DEVICE)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    workspace = DecodeWorkspace()
    for buffer in workspace.get(q, 2 + rest_parts(kv, blocks)):
        buffer.fill_(float("nan"))
    out = decode_attention(q, kv, 64 ** -0.5, num_splits=2, workspace=workspace, rest_blocks=blocks)
    assert torch.isfinite(out).all()
    assert rel_err(out, decode_attention_ref(q, kv, 64 ** -0.5)) < 2e-3


def test_remaining_blocks_a_program_follow_the_launch_size():
    """One block a program while a launch has at most 8 blocks a multiprocessor (Qwen3-8B's kitty-pro, 9 blocks a
    sequence and KV head, 132 multiprocessors: batches 1-8) or its sequences fewer than REST_LOOP_PAGES pages (4K
    tokens: 32), else about a quarter of its blocks a multiprocessor, shared evenly: at batch 64 / 32K 8 would make
    programs of 8 and 1 blocks, so 5 (5 and 4); never more than a sequence's."""
    assert rest_blocks_per_program(8 * 1, 9, 132, 256) == 1 and rest_blocks_per_program(8 * 8, 9, 132, 256) == 1
    assert rest_blocks_per_program(8 * 16, 9, 132, 256) == 2 and rest_blocks_per_program(8 * 32, 9, 132, 256) == 3
    assert rest_blocks_per_program(8 * 64, 9, 132, 256) == 5 and rest_blocks_per_program(8 * 1000, 9, 132, 256) == 9
    assert rest_blocks_per_program(8 * 64, 9, 132, 32) == 1 and rest_blocks_per_program(8 * 64, 9, 132, 127) == 1
    assert rest_blocks_per_program(8 * 64, 9, 132, REST_LOOP_PAGES) == 5
    assert rest_blocks_per_program(8 * 64, 10, 132, 256) == 5            # 10 blocks (a spread of 13): 5 and 5


def test_remaining_blocks_cap_only_their_longer_loops():
    """A register cap of 168 only for 2-warp programs of 3 blocks or more (their loop takes 251 registers at the
    compiler's choice, 168 without spills); 1 or 2 blocks a program, and other warp counts, keep the compiler's."""
    assert rest_maxnreg(2, 5) == rest_maxnreg(2, 3) == 168
    assert rest_maxnreg(2, 2) is None and rest_maxnreg(2, 1) is None
    assert rest_maxnreg(4, 5) is None and rest_maxnreg(1, 9) is None


@pytest.mark.parametrize("kernel", [*KERNELS, "gluon-tma+zq-ahead+fold-max"])
def test_decode_attention_before_the_first_page(kernel):
    """A cache's page tables have no column until its first page (backend/pages.py): every kernel choice reads
    none of them (on a GPU, the Gluon kernel declines such a launch, and its programs without slots read no table
    entry) and matches the reference over the sink and buffers."""
    kv, _, _ = random_paged_kv([20, 100, 31], heads=2, head_dim=128, sink=32, page_size=128, window=128,
                               n_boost=32, dtype=torch.bfloat16, seed=9, device=DEVICE)
    kv = dataclasses.replace(kv, k_table=kv.k_table[:, :0].contiguous(), v_table=kv.v_table[:, :0].contiguous())
    q = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    out = decode_attention(q, kv, 128 ** -0.5, kernel=kernel)
    assert rel_err(out, decode_attention_ref(q, kv, 128 ** -0.5)) < 1.5e-2


def test_gluon_kernel_compiles_for_hopper_with_register_operands():
    """Without a GPU: the Gluon kernel compiles for sm_90 (its operand layouts are checked to be register renamings
    when it is built: convert_layout(..., assert_trivial=True)); its page loop holds exactly the matrix products the
    page needs, no spills in it with TMA (one load a page at most with cp.async) with the compiler's registers and at
    the default cap, 16-byte cp.async copies of the codes, the shared memory that shared_bytes plans occupancy
    with."""
    code = textwrap.dedent("""
        import torch
        from kernels.decode_gluon import shared_bytes
        from kernels.sass_profile import compile_gluon_kernel, example_paged_kv, profile
        for method, dtype, maxnreg, tma in (("kitty-pro", torch.bfloat16, 255, False),
                                            ("kivi-k2v2", torch.float16, 255, False),
                                            ("kitty", torch.bfloat16, 255, False),
                                            ("kitty-pro", torch.bfloat16, 168, False),
                                            ("kitty-pro", torch.bfloat16, 168, True)):
            compiled = compile_gluon_kernel(method, dtype, 4, maxnreg=maxnreg, use_tma=tma)
            row = profile(compiled)
            ptx = compiled.asm["ptx"]
            wide = ptx.count("cp.async.bulk.tensor") if tma else ptx.count("cp.async.cg.shared.global [")
            planned = shared_bytes(example_paged_kv(method, 8, 128, dtype), 128, use_tma=tma)
            print(method + ("-168" if maxnreg < 255 else "") + ("-tma" if tma else ""), row["loop matrix"],
                  row["loop local ld/st"], row["shared bytes"], planned, wide)
    """)
    run = compile_on_cpu(code)
    rows = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in run.stdout.splitlines()}
    # kitty-pro: 4 quarters x (2 x 8 key + 2 x 2 boosted + 2 x 8 value tiles) products; kivi-k2v2: no boosted plane;
    # kitty: 16 boosted channels, one 16-column tile. Each also has the products for the sums: the keys' zero term
    # with ones, one per 16 channels (its two 16-row tiles are one product, which the compiler shares), and the sums
    # of p and of p * zero together, one per 16 tokens (decode_gluon._zero_rows)
    ones = 128 // 16 + 128 // 16
    assert rows["kitty-pro"][0] == 4 * (16 + 4 + 16) + ones, run.stdout
    assert rows["kivi-k2v2"][0] == 4 * (16 + 16) + ones, run.stdout
    assert rows["kitty"][0] == 4 * (16 + 2 + 16) + ones, run.stdout
    # at the default cap of 168 registers (decode_attention.GLUON_MAXNREG), and with TMA copies: the same page loop
    assert rows["kitty-pro-168"][0] == rows["kitty-pro"][0] == rows["kitty-pro-168-tma"][0], run.stdout
    # no spills in the page loop with TMA; the cp.async kernel (GPUs before Hopper) at most one load a page of a value
    # held through the loop (triton 3.7.1 with the whole-bytes unpacking, none with triton 3.6)
    for method, (matrix, spills, shared, planned, wide) in rows.items():
        assert spills <= (0 if method.endswith("-tma") else 1) and shared == planned, run.stdout
    # a page's key and value codes in 16-byte cp.async copies
    assert rows["kitty-pro"][4] >= (4096 + 1024 + 4096) // 16 // 32 and rows["kivi-k2v2"][4] >= 8192 // 16 // 32
    assert rows["kitty"][4] >= (4096 + 512 + 4096) // 16 // 32, run.stdout
    # with TMA: a box per plane and a box per vector, 8 a kitty-pro page (3 planes, 5 vectors), issued once in the
    # first slots and once in the loop
    assert rows["kitty-pro-168-tma"][4] == 2 * 8, run.stdout


def test_i8_kernels_compile_for_hopper_with_integer_products():
    """Without a GPU: the 8-bit products' kernels (decode_attention(kernel="gluon-tma-i8k" / "gluon-tma-i8")) compile
    for sm_90 with the products a kitty-pro page needs and no spills in the page loop at the default cap; the keys'
    kernel also at 128 registers (16 programs a multiprocessor: bench tune --vary i8), where the fp16 kernel spills."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_gluon_kernel, profile
        for name, i8, maxnreg in (("i8k", 1, 168), ("i8k-128", 1, 128), ("i8", 2, 168)):
            row = profile(compile_gluon_kernel("kitty-pro", torch.bfloat16, 4, maxnreg=maxnreg, use_tma=True, i8=i8))
            print(name, row["loop integer matrix"], row["loop matrix"] - row["loop integer matrix"],
                  row["loop local ld/st"])
    """)
    run = compile_on_cpu(code)
    rows = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in run.stdout.splitlines()}
    # m16n8k32 over a 32-token quarter (2 row tiles) and 32 columns: 4 quarters and the -64 correction of field 3
    # (I8_MINUS64), for 4 channel chunks and the one boosted chunk; the values: 4 token quarters of 32 channels.
    # The products for the sums stay fp16: the keys' zero term with ones (2 a 32-channel chunk), the sums of p and of
    # p * zero together (2 a token quarter); the 8-bit keys' kernel keeps the fp16 value products (16 a token quarter)
    keys, values = (4 + 1) * 5 * 2, 4 * 5 * 2
    ones = 4 * 2 + 4 * 2
    assert rows["i8k"][:2] == rows["i8k-128"][:2] == [keys, 4 * 16 + ones], run.stdout
    assert rows["i8"][:2] == [keys + values, ones], run.stdout
    assert all(spills == 0 for _, _, spills in rows.values()), run.stdout


def test_kernel_names_add_experiments_and_bad_names_are_refused():
    """decode_attention's kernel names: a name of KERNELS, or a Gluon kernel with experiments "+name" each, in any
    order (the same options); each refusal is a ValueError that names the choices: an unknown base or experiment,
    experiments on a kernel that is not a Gluon kernel, one twice, fold-max without zq-ahead or with the 8-bit key
    products, q-rows with them, a name that is not a string. decode_attention refuses them before it launches
    anything."""
    from kernels.decode_gluon import kernel_options
    assert kernel_parts("gluon-tma+fold-max+zq-ahead") == ("gluon-tma", ("fold-max", "zq-ahead"))
    assert kernel_options("gluon-tma+fold-max+zq-ahead") == kernel_options("gluon-tma+zq-ahead+fold-max") == dict(
        use_tma=True, i8=0, zq_ahead=True, fold_max=True, q_rows=False)
    assert kernel_options("gluon") == dict(use_tma=False, i8=0, zq_ahead=False, fold_max=False, q_rows=False)
    assert kernel_options("gluon+q-rows")["q_rows"]
    assert kernel_options("gluon-tma-i8+zq-ahead")["i8"] == 2 and is_gluon("gluon-tma-i8+zq-ahead")
    assert not is_gluon("triton") and not is_gluon("auto")
    for name in KERNELS:
        assert check_kernel(name) == name
    kv, _, _ = random_paged_kv([40], heads=1, head_dim=64, sink=4, page_size=16, window=16, dtype=torch.float32,
                               seed=1, device=DEVICE)
    q = torch.randn(1, 2, 64, device=DEVICE)
    for bad in ("cuda", "triton+zq-ahead", "auto+zq-ahead", "gluon-tma+zq", "gluon-tma+", "gluon-tma+zero-heads",
                "gluon+zq-ahead+zq-ahead", "gluon-tma+fold-max", "gluon-tma-i8k+zq-ahead+fold-max",
                "gluon-tma-i8k+q-rows", None):
        with pytest.raises(ValueError, match="decode kernel"):
            check_kernel(bad)
        if isinstance(bad, str):
            with pytest.raises(ValueError, match="decode kernel"):
                decode_attention(q, kv, 0.125, kernel=bad)


def test_experiments_compile_with_the_products_they_say():
    """Without a GPU, at the default cap with TMA copies (sm_90), each of decode_attention.GLUON_EXPERIMENTS against
    the default's page loop ("gluon-tma"), for kitty-pro and kivi-k2v2:
    - zq-ahead takes off the keys' zero term's 8 products with ones (128 channels / 16) and the 16 HMUL2 of q * zero
      a page, and the zeros' vector copy (a box); outside the page loop, a window's ZQ_SLOTS / 16 product chains of
      128 / 16 products each; its shared memory is what shared_bytes plans;
    - fold-max (with zq-ahead) takes 20 or more instructions a page off that: the 32 FADD of score less max, against
      8 FMUL for the 4 quarters' weighted maxima, and no more shuffles;
    - q-rows (with both) takes 50 or more off that for kitty-pro (triton 3.6: 73), whose 32 boosted channels' queries
      and scales come in 2 loads a lane instead of 16 (4 LDG a page left), with the same products and shared memory;
      kivi-k2v2 has no boosted channels: the same page loop.
    No page loop spills."""
    code = textwrap.dedent("""
        import torch
        from kernels.decode_gluon import shared_bytes
        from kernels.sass_profile import compile_gluon_kernel, example_paged_kv, profile
        kernels = {"default": {}, "zq-ahead": dict(zq_ahead=True), "fold-max": dict(zq_ahead=True, fold_max=True),
                   "q-rows": dict(zq_ahead=True, fold_max=True, q_rows=True)}
        for method in ("kitty-pro", "kivi-k2v2"):
            for name, options in kernels.items():
                compiled = compile_gluon_kernel(method, torch.bfloat16, 4, maxnreg=168, use_tma=True, **options)
                row = profile(compiled)
                opcodes = row["loop opcodes"]
                planned = shared_bytes(example_paged_kv(method, 8, 128, torch.bfloat16), 128, use_tma=True,
                                       zq_ahead=options.get("zq_ahead", False))
                print(method, name, row["loop instructions"], row["loop matrix"], row["loop local ld/st"],
                      *(opcodes.get(op, 0) for op in ("HMUL2", "FADD", "SHFL", "UTMALDG", "LDG")), row["matrix"],
                      row["shared bytes"], planned)
    """)
    run = compile_on_cpu(code, timeout=900)
    rows = {tuple(line.split()[:2]): dict(zip(("instructions", "matrix", "spills", "HMUL2", "FADD", "SHFL", "boxes",
                                               "LDG", "all matrix", "shared", "planned"), map(int, line.split()[2:])))
            for line in run.stdout.splitlines()}
    window = 64 // 16 * (128 // 16)                         # decode_gluon.ZQ_SLOTS: its products outside the loop
    assert all(row["spills"] == 0 and row["shared"] == row["planned"] for row in rows.values()), run.stdout
    for method in ("kitty-pro", "kivi-k2v2"):
        default, ahead, fold, q_rows = (rows[method, name] for name in ("default", "zq-ahead", "fold-max", "q-rows"))
        assert default["all matrix"] == default["matrix"], run.stdout
        assert ahead["matrix"] == default["matrix"] - 8 and ahead["HMUL2"] == default["HMUL2"] - 16, run.stdout
        assert ahead["all matrix"] == ahead["matrix"] + window and ahead["boxes"] == default["boxes"] - 1, run.stdout
        assert fold["matrix"] == ahead["matrix"] and fold["FADD"] <= ahead["FADD"] - 24, run.stdout
        assert fold["instructions"] <= ahead["instructions"] - 16 and fold["SHFL"] == ahead["SHFL"], run.stdout
        assert q_rows["matrix"] == fold["matrix"] and q_rows["shared"] == fold["shared"], run.stdout
    assert rows["kitty-pro", "q-rows"]["instructions"] <= rows["kitty-pro", "fold-max"]["instructions"] - 50, run.stdout
    assert rows["kitty-pro", "q-rows"]["LDG"] <= 4 < rows["kitty-pro", "fold-max"]["LDG"], run.stdout
    assert rows["kivi-k2v2", "q-rows"]["instructions"] == rows["kivi-k2v2", "fold-max"]["instructions"], run.stdout


def run_ptx(asm: str, inputs: list[np.ndarray], outputs: int) -> list[np.ndarray]:
    """The few 32-bit PTX instructions of decode_gluon's unpacking strings (and, mov, prmt, mad.lo), run on
    uint32 arrays: $0 .. $(outputs - 1) are the results, the inputs follow."""
    regs = {f"${outputs + i}": x.astype(np.uint64) for i, x in enumerate(inputs)}

    def value(operand):
        return regs[operand] if operand.startswith("$") else np.uint64(int(operand, 0) & 0xFFFFFFFF)

    for instruction in filter(None, (part.strip() for part in asm.split(";"))):
        op, operands = instruction.split(None, 1)
        dest, *args = [a.strip() for a in operands.split(",")]
        a = [value(x) for x in args]
        if op == "and.b32":
            result = a[0] & a[1]
        elif op == "mov.b32":
            result = a[0] + np.uint64(0)
        elif op == "mad.lo.u32":
            result = (a[0] * a[1] + a[2]) & np.uint64(0xFFFFFFFF)
        elif op == "prmt.b32":               # default mode: byte i of the result is byte (selector nibble i) of {b, a}
            pool = a[0] | (a[1] << np.uint64(32))
            result = np.zeros_like(pool)
            for i in range(4):
                nibble = (int(a[2]) >> 4 * i) & 0xF
                byte = (pool >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)
                if nibble & 8:                  # the byte's sign bit replicated
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                result |= byte << np.uint64(8 * i)
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[dest] = result & np.uint64(0xFFFFFFFF)
    return [regs[f"${i}"].astype(np.uint32) for i in range(outputs)]


def test_unpacking_strings_make_the_operands_they_say():
    """On the CPU, the Gluon kernel's unpacking strings (decode_gluon's SPREAD and QUARTER_ASM) run on random code
    words by a small emulation of their PTX: quarters 0-2's fp16 operands are code * 4^i * 2^-24 (subnormal: no
    exponent bit set), bytes 0 and 2 in the first register, 1 and 3 in the second (the pairing layout.SWAP stores
    for); quarter 3's are the whole bytes, byte * 2^-24, the sum of the 4 fields' operands (so that its products
    less the other quarters' are field 3's)."""
    from kernels import decode_gluon
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    fields = (words[:, None] >> (8 * np.arange(4)).astype(np.uint32)) & 0xFF            # (word, byte)

    def operands(registers):
        """Two registers of fp16 pairs -> their elements as bytes 0, 1, 2, 3 of the word, in float64."""
        first, second = (r.view(np.float16).reshape(-1, 2).astype(np.float64) for r in registers)
        assert (np.concatenate(registers).view(np.uint16) & 0x7C00 == 0).all(), "an exponent bit set"
        return np.stack([first[:, 0], second[:, 0], first[:, 1], second[:, 1]], axis=1)

    t, u = run_ptx(decode_gluon.SPREAD.value, [words], 2)
    quarters = decode_gluon.QUARTER_ASM.value
    assert len(quarters) == 4
    for i, asm in enumerate(quarters[:3]):
        expected = ((fields >> (2 * i)) & 3) * 4.0 ** i * 2.0 ** -24
        assert np.array_equal(operands(run_ptx(asm, [t, u], 2)), expected), i
    assert np.array_equal(operands(run_ptx(quarters[3], [t, u], 2)), fields * 2.0 ** -24)


def test_the_page_unpacks_a_word_in_seven_integer_instructions():
    """Without a GPU: the default kernel's page loop unpacks a word of 16 codes in 6 AND, a byte permute and an IMAD
    (decode_gluon's SPREAD and QUARTER_ASM: no shift), 72 words a kitty-pro page a thread (4,096 + 1,024 + 4,096
    bytes), 64 a kivi-k2v2 page; besides those, at most 8 PRMT (the bytes of the boosted channels' list that their
    gathers address; the second operands need none: layout.SWAP) and 2 LOP3. Quarter 3's sums less the other
    quarters' cost the keys 3 FADD a score element (24 a page); the page has no spills at the default cap."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_gluon_kernel, profile
        for method in ("kitty-pro", "kivi-k2v2"):
            row = profile(compile_gluon_kernel(method, torch.bfloat16, 4, maxnreg=168, use_tma=True))
            ops = row["loop opcodes"]
            print(method, ops["LOP3"], ops.get("SHF", 0), ops.get("PRMT", 0), ops.get("IMAD", 0), ops.get("FADD", 0),
                  row["loop local ld/st"])
    """)
    run = compile_on_cpu(code)
    rows = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in run.stdout.splitlines()}
    for method, words in (("kitty-pro", 72), ("kivi-k2v2", 64)):
        lop3, shf, prmt, imad, fadd, spills = rows[method]
        assert 6 * words <= lop3 <= 6 * words + 2 and shf == 0 and words <= prmt <= words + 8, run.stdout
        assert imad >= words and fadd >= 24 and spills == 0, run.stdout


def test_the_kernels_halves_keep_its_copies_or_its_products():
    """Without a GPU: the paged kernel with COMPUTE=False (bench tune --vary loads, the memory pipeline's ceiling)
    issues the same TMA copies (2-D boxes: a plane's whole rows, layout.py) and mbarrier waits a page as the kernel
    it measures, and no products; with COPIES=False (the arithmetic's own time) the same products in its loop, and
    no copy or wait there (the first slot's pages only, before it)."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_gluon_kernel, profile
        for compute, copies in ((True, True), (False, True), (True, False)):
            compiled = compile_gluon_kernel("kitty-pro", torch.bfloat16, 4, maxnreg=168, use_tma=True, compute=compute,
                                            copies=copies)
            ptx = compiled.asm["ptx"]
            row = profile(compiled)
            print(compute, ptx.count("cp.async.bulk.tensor.2d"), ptx.count("mbarrier.try_wait"), row["loop matrix"],
                  ptx.count("cp.async.bulk.tensor.3d"), row["loop instructions"])
    """)
    run = compile_on_cpu(code)
    full, copies, arithmetic = ([int(x) for x in line.split()[1:]] for line in run.stdout.splitlines())
    assert copies[:2] == full[:2] and full[0] > 0 and full[1] > 0, run.stdout
    assert copies[2] == 0 < full[2] and copies[3] == full[3] == 0, run.stdout
    # the first slot's 8 copies and one wait a kind
    assert arithmetic[:4] == [8, 2, full[2], 0] and arithmetic[4] < full[4], run.stdout


def test_the_kernels_timeline_reads_the_clock_outside_its_loop():
    """Without a GPU: with times_ptr (bench tune --vary timeline) the paged kernel reads %globaltimer when a program
    starts and ends and %smid once, and its page loop is the same instructions as without, within two that the
    compiler moves across the loop's edge (an IMAD, a UMOV: the start time is held through the loop; triton 3.6
    and 3.7.1); with WAITS it also reads %clock64 at its start and end and around each of a page's two waits
    (one for keys, one for values)."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_gluon_kernel, profile
        for times, waits in ((False, False), (True, False), (True, True)):
            compiled = compile_gluon_kernel("kitty-pro", torch.bfloat16, 4, maxnreg=168, use_tma=True, times=times,
                                            waits=waits)
            ptx = compiled.asm["ptx"]
            print(profile(compiled)["loop instructions"], ptx.count("%globaltimer"), ptx.count("%smid"),
                  ptx.count("%clock64"))
    """)
    run = compile_on_cpu(code)
    without, with_times, with_waits = ([int(x) for x in line.split()] for line in run.stdout.splitlines())
    assert without[1:] == [0, 0, 0] and with_times[1:] == [2, 1, 0], run.stdout
    assert abs(with_times[0] - without[0]) <= 2, run.stdout
    assert with_waits[1:] == [2, 1, 6] and with_waits[0] > without[0], run.stdout


def test_the_remaining_blocks_timeline_reads_the_clock_twice():
    """Without a GPU: with times_ptr (bench tune --vary timeline's whole call) the remaining blocks' kernel reads
    %globaltimer when a program starts and ends and %smid once, with one block a program and with five; without, none
    of them."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_rest_kernel
        for times in (False, True):
            for blocks in (1, 5):
                ptx = compile_rest_kernel("kitty-pro", torch.bfloat16, 4, blocks_per_program=blocks,
                                          times=times).asm["ptx"]
                print(ptx.count("%globaltimer"), ptx.count("%smid"))
    """)
    run = compile_on_cpu(code)
    assert run.stdout.split() == ["0", "0"] * 2 + ["2", "1"] * 2, run.stdout


def test_rest_keys_codes_compile_into_the_remaining_blocks_kernel_for_hopper():
    """Without a GPU, for sm_90: with rest_keys "codes" the remaining blocks' kernel holds field_asm's PTX (two of
    its 16-bit fused multiply-adds for each 4 bytes: 40 in all, a key tile of 32 tokens by 128 channels and 32
    boosted channels at 2 warps), bf16 and fp16 alike, with fewer instructions in its loop over blocks and no spills
    at decode_rest's register cap; with "elements", none of them."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_rest_kernel, profile
        for dtype, fma in ((torch.bfloat16, "fma.rn.bf16x2"), (torch.float16, "fma.rn.f16x2")):
            for keys in ("elements", "codes"):
                kernel = compile_rest_kernel("kitty-pro", dtype, 4, num_warps=2, blocks_per_program=5, maxnreg=168,
                                             keys=keys)
                row = profile(kernel)
                print(kernel.asm["ptx"].count(fma), row["stack bytes"], row["loop instructions"])
    """)
    run = compile_on_cpu(code)
    rows = [[int(x) for x in line.split()] for line in run.stdout.splitlines()]
    for elements, codes in (rows[0:2], rows[2:4]):
        assert elements[:2] == [0, 0] and codes[:2] == [40, 0] and codes[2] < elements[2], run.stdout


def test_rest_keys_auto_takes_codes_beside_long_paged_launches_and_alone():
    """rest_keys "auto" (the default) reads a key page's remaining blocks as "codes" where their programs take
    CODES_BLOCKS blocks or more (measured faster at batch 64 / 32K, 5 a program) or have a multiprocessor each
    (faster at batch 1), else as "elements" (faster at batch 8 and at 64 / 4K, one block a program); the default
    launch at that many blocks a program gives the reference's output."""
    from kernels.decode_attention import CODES_BLOCKS, REST_KEYS, choose_rest_keys
    assert REST_KEYS == "auto"
    assert [choose_rest_keys(n, 1024, 132) for n in (1, 2, 4, 5, 9)] == ["elements"] * 3 + ["codes"] * 2
    assert choose_rest_keys(1, 72, 132) == choose_rest_keys(1, 132, 132) == "codes"         # batch 1: 8 x 9
    assert choose_rest_keys(1, 133, 132) == "elements"
    kv, _, _ = random_paged_kv([405, 130], heads=1, head_dim=64, page_size=128, window=128, n_boost=8,
                               dtype=torch.float16, seed=3, device=DEVICE)
    q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    out = decode_attention(q, kv, 64 ** -0.5, num_splits=2, rest_blocks=CODES_BLOCKS)
    assert rel_err(out, decode_attention_ref(q, kv, 64 ** -0.5)) < 2e-3


def test_a_calls_timeline_takes_a_gluon_paged_kernel():
    """decode_launches' times (bench tune --vary timeline's whole call): on a GPU with a Gluon kernel, every program
    of the paged launch and of the remaining blocks' writes its row (start before end, its multiprocessor), the rows
    past the launches' programs stay as they were, and the call decodes what it decodes without them; with the
    Triton kernel (a CPU's), a ValueError before anything runs."""
    kv, _, _ = random_paged_kv([600, 170], heads=2, head_dim=128, sink=32, page_size=64, window=64, n_boost=16,
                               dtype=torch.bfloat16, seed=7, device=DEVICE)
    q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    paged = torch.zeros(2 * 2 * 3 + 5, 8, dtype=torch.int64, device=DEVICE)
    rest = torch.zeros(2 * 2 * rest_parts(kv) + 5, 8, dtype=torch.int64, device=DEVICE)
    if DEVICE != "cuda" or not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Gluon kernel"):
            decode_launches(q, kv, 128 ** -0.5, num_splits=3, times=(paged, rest))
        return
    kernel = "gluon-tma" if torch.cuda.get_device_capability()[0] == 9 else "gluon"
    out = decode_launches(q, kv, 128 ** -0.5, num_splits=3, kernel=kernel, rest_blocks=1, times=(paged, rest))()
    expected = decode_attention(q, kv, 128 ** -0.5, num_splits=3, kernel=kernel, rest_blocks=1)
    assert torch.equal(out, expected)
    sms = multiprocessors(q.device)
    for rows, programs in ((paged.cpu(), 2 * 2 * 3), (rest.cpu(), 2 * 2 * rest_parts(kv))):
        written = rows[:programs]
        assert (written[:, 0] > 0).all() and (written[:, 1] >= written[:, 0]).all(), written
        assert ((written[:, 2] >= 0) & (written[:, 2] < sms)).all() and not rows[programs:].any()


def test_tma_destinations_are_aligned_in_shared_memory():
    """Without a GPU: every TMA copy of the Gluon kernel writes to a 128-byte aligned shared-memory offset, for the
    methods with 0, 16 and 32 boosted channels (decode_gluon.TMA_ALIGN: with a second value buffer in session 27,
    kitty's 16-byte list of boosted channels landed at offset 16,912 and the H200 stopped on "misaligned
    address"). The offsets are read from the PTX: each destination register is global_smem plus a constant."""
    code = textwrap.dedent(r"""
        import re, torch
        from kernels.sass_profile import compile_gluon_kernel
        for method, group, heads in (("kitty-pro", 4, 8), ("kitty", 3, 3), ("kivi-k2v2", 4, 8)):
            ptx = compile_gluon_kernel(method, torch.bfloat16, group, heads=heads, maxnreg=168, use_tma=True).asm["ptx"]
            base = set(re.findall(r"mov\.b32\s+(%r\d+), global_smem;", ptx))
            offset = {reg: 0 for reg in base}
            for reg, src, const in re.findall(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);", ptx):
                if src in base:
                    offset[reg] = int(const)
            dests = re.findall(r"cp\.async\.bulk\.tensor\S* \[(%r\d+)\]", ptx)
            print(method, len(dests), " ".join(str(offset.get(d, -1)) for d in dests))
    """)
    run = compile_on_cpu(code)
    for line in run.stdout.splitlines():
        method, count, *offsets = line.split()
        # a box per plane and per vector, in the first slots and in the loop (kitty-pro: 3 planes, 5 vectors)
        assert int(count) >= 2 * 4 and len(offsets) == int(count), run.stdout
        assert all(int(o) >= 0 and int(o) % 128 == 0 for o in offsets), f"{method}: {offsets} ({run.stdout})"


def test_padded_kernels_add_the_instructions_they_say():
    """Without a GPU: the measurement of what one more instruction costs (decode_gluon's PAD, bench tune --vary
    pad) adds to the page loop the LOP3, FFMA or HMMA instructions it is asked for, and few others."""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import compile_gluon_kernel, profile
        for pad in (None, ("alu", 64), ("fma", 64), ("mma", 8)):
            row = profile(compile_gluon_kernel("kitty-pro", torch.bfloat16, 4, maxnreg=168, use_tma=True, pad=pad))
            print(row["loop instructions"], row["loop opcodes"]["LOP3"], row["loop float"], row["loop matrix"])
    """)
    run = compile_on_cpu(code)
    plain, alu, fma, mma = ([int(x) for x in line.split()] for line in run.stdout.splitlines())
    assert alu[1] - plain[1] == 64 and alu[0] - plain[0] <= 68, run.stdout
    assert 64 <= fma[2] - plain[2] <= 76 and fma[0] - plain[0] <= 80, run.stdout
    assert mma[3] - plain[3] == 8 and mma[0] - plain[0] <= 32, run.stdout


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the TMA kernel runs on Hopper GPUs only")
def test_padded_kernels_compute_the_same_partials():
    """On the H200: each pad of bench tune --vary pad leaves the paged launch's partials as they were, to the bit."""
    from kernels import decode_gluon
    kv, _, _ = random_paged_kv([4100, 900], heads=2, head_dim=128, sink=32, page_size=128, window=128, n_boost=32,
                               dtype=torch.bfloat16, seed=6, device=DEVICE)
    q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    results = []
    for pad in (None, ("alu", 64), ("fma", 64), ("mma", 8)):
        parts = (torch.full((2, 8, 3, 128), float("nan"), device=DEVICE), torch.full((2, 8, 3), float("nan"),
                 device=DEVICE), torch.full((2, 8, 3), float("nan"), device=DEVICE))
        decode_gluon.launch(q, kv, 0.1, parts, 3, 168, use_tma=True, pad=pad)
        results.append(parts)
    for parts in results[1:]:
        for got, want in zip(parts, results[0]):
            torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the TMA kernel runs on Hopper GPUs only")
def test_launches_in_a_row_are_timed_eager_and_in_a_graph():
    """On the H200: bench tune's back_to_back runs the paged launch 8 times eagerly and in one CUDA graph, and every
    launch writes its programs' times to its own buffer (each span positive, under a second)."""
    from backend.bench import back_to_back, paged_half
    kv, _, _ = random_paged_kv([4100, 900], heads=2, head_dim=128, sink=32, page_size=128, window=128, n_boost=32,
                               dtype=torch.bfloat16, seed=6, device=DEVICE)
    q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    result = back_to_back(lambda times: paged_half(q, kv, 3, 168, "whole", times), 2 * 2 * 3, DEVICE)
    assert set(result) == {"eager", "graph"}
    for summary in result.values():
        assert 0 < summary["span_min_us"] <= summary["span_max_us"] < 1e6, result


def test_pdl_compiles_into_the_kernels_for_hopper():
    """decode_attention(pdl=True): either paged kernel lets the remaining blocks' kernel launch at once
    (griddepcontrol.launch_dependents), which lets the merge launch at once and waits for the paged grid before it
    ends (griddepcontrol.wait), and the merge waits for it before it reads a partial; compiled for sm_90 without a
    GPU, the Gluon page loop unchanged. Without the option none of these instructions is there. (Its results on a
    GPU: test_decode_attention_with_pdl_equals_without.)"""
    code = textwrap.dedent("""
        import torch
        from kernels.sass_profile import (compile_gluon_kernel, compile_merge_kernel, compile_rest_kernel,
                                          compile_split_kernel, profile)
        for on in (False, True):
            rest = compile_rest_kernel("kitty-pro", torch.bfloat16, 4, pdl=on).asm["ptx"]
            split = compile_split_kernel("kitty-pro", torch.bfloat16, 4, pdl=on).asm["ptx"]
            gluon = compile_gluon_kernel("kitty-pro", torch.bfloat16, 4, maxnreg=168, use_tma=True, pdl=on)
            merge = compile_merge_kernel(pdl=on).asm["ptx"]
            print(on, "griddepcontrol.launch_dependents" in split,
                  "griddepcontrol.launch_dependents" in gluon.asm["ptx"],
                  "griddepcontrol.launch_dependents" in rest and "griddepcontrol.wait" in rest,
                  "griddepcontrol.wait" in merge, profile(gluon)["loop instructions"])
    """)
    run = compile_on_cpu(code)
    plain, chained = (line.split() for line in run.stdout.splitlines())
    assert plain[:5] == ["False"] * 5 and chained[:5] == ["True"] * 5, run.stdout
    assert plain[5] == chained[5], run.stdout


@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper or later GPU")
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_decode_attention_with_pdl_equals_without(kernel):
    """The same partials in either launch order, so the same output to the bit (one sequence, as at batch 1, a
    ragged batch with a sequence shorter than a page, and 48 sequences of 8 KV heads whose paged programs fill the
    multiprocessors while the remaining blocks' programs end long before them), also under a CUDA graph as decode
    steps replay it, and with the partials poisoned first: a merge that read before a partial was written would
    differ."""
    for lengths, heads, copies in (([4100], 2, 1), ([4100, 300, 1], 2, 1), ([8200], 8, 48)):
        kv, _, _ = random_paged_kv(lengths, heads=heads, head_dim=128, n_boost=32, seed=5, device=DEVICE,
                                   dtype=torch.bfloat16)
        kv = same_sequences(kv, copies)
        q = torch.randn(len(lengths) * copies, 4 * heads, 128, generator=torch.Generator().manual_seed(2))
        q = q.to(torch.bfloat16).to(DEVICE)
        plain = decode_attention(q, kv, 128 ** -0.5, kernel=kernel, pdl=False).clone()     # PDL is the default
        workspace = DecodeWorkspace()
        decode_attention(q, kv, 128 ** -0.5, kernel=kernel, pdl=True, workspace=workspace)
        torch.testing.assert_close(workspace.buffers[3], plain, atol=0, rtol=0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, kv, 128 ** -0.5, kernel=kernel, pdl=True, workspace=workspace)
        for _ in range(3):
            for buffer in workspace.buffers:
                buffer.fill_(float("nan"))
            graph.replay()
            torch.testing.assert_close(out, plain, atol=0, rtol=0)


def same_sequences(kv, n: int):
    """A cache's sequences n times over, each copy reading the same pages (their tables point at them) and buffers
    (n = 1: the cache as it is)."""
    rows = lambda t: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731
    return dataclasses.replace(kv, k_fp=rows(kv.k_fp), v_fp=rows(kv.v_fp), k_table=rows(kv.k_table),
                               v_table=rows(kv.v_table), seq_len=rows(kv.seq_len), n_kpages=rows(kv.n_kpages),
                               n_vpages=rows(kv.n_vpages))


def test_default_splits_are_the_h200_sweeps_best():
    """The split counts bench tune found best on the H200 (BENCHMARKS.md section 1) at the Qwen3-8B shapes: 8 KV
    heads, pages of 128 tokens, 132 multiprocessors."""
    chosen = {(b, tokens): default_splits(b, 8, tokens // 128) for b in (1, 8, 64) for tokens in (4096, 32768)}
    assert chosen == {(1, 4096): 32, (8, 4096): 16, (64, 4096): 4, (1, 32768): 128, (8, 32768): 33, (64, 32768): 4}


def test_gluon_splits_are_the_h200_sweeps_best():
    """The Gluon kernel's split counts (balanced_splits) at the Qwen3-8B shapes, 12 resident programs (168
    registers) on 132 multiprocessors: one page a program where one wave holds them all, else the busiest
    scheduler's fewest pages among 8 to 12 programs a multiprocessor. Each is the best bench tune measured on the
    H200 or within 2 % of it (BENCHMARKS.md section 1, session 16; 32 / 4K: 2.1 % slower than 6 splits in call 3,
    0.2 % in call 2)."""
    chosen = {(b, tokens): balanced_splits(b, 8, tokens // 128, 132, 12)
              for b in (1, 2, 4, 8, 16, 32, 64) for tokens in (4096, 32768)}
    assert chosen == {(1, 4096): 32, (2, 4096): 32, (4, 4096): 32, (8, 4096): 16, (16, 4096): 8, (32, 4096): 4,
                      (64, 4096): 2, (1, 32768): 132, (2, 32768): 66, (4, 32768): 33, (8, 32768): 16,
                      (16, 32768): 8, (32, 32768): 6, (64, 32768): 3}
    # fewer resident programs than the balanced minimum: a full wave of them
    assert balanced_splits(64, 8, 256, 132, 4) == 1 and balanced_splits(8, 8, 256, 132, 6) == 12


def test_gluon_register_cap_follows_the_programs_a_multiprocessor():
    """gluon_maxnreg: 192 registers where a launch's programs are at most the 8 a multiprocessor holds at 192, else
    168 (on a CPU, 4 multiprocessors stand in)."""
    from kernels.sass_profile import example_paged_kv
    kv = example_paged_kv("kitty-pro", 8, 128, torch.bfloat16)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    assert gluon_maxnreg(q, kv, 4) == GLUON_MAXNREG_FEW            # 8 heads x 4 splits over 4: 8 a multiprocessor
    assert gluon_maxnreg(q, kv, 5) == GLUON_MAXNREG                # 10


@pytest.mark.parametrize("method", ["kitty-pro", "kitty", "kivi-k2v2"])
def test_auto_folds_the_max_only_where_programs_walk_many_pages(method):
    """decode_attention's "auto" on Hopper takes FOLDED_KERNEL (zq-ahead and fold-max) where the plain kernel's
    programs would walk FOLD_PAGES pages or more (folds_max): on the H200 it was faster at 64 / 32K, 32 / 32K, 64 /
    16K and 32 / 16K, 86, 43, 43 and 32 pages a program at Qwen3-8B's shapes on 132 multiprocessors (BENCHMARKS.md
    section 1, session 39), and not at 1 / 32K, 2 (session 38). 16 / 32K walks 32 too; the shapes of 16 pages a
    program (8 / 32K, 64 / 4K) were not measured and keep the plain kernel; a batch of 128 walks more pages."""
    import dataclasses

    from kernels.sass_profile import example_paged_kv
    kv = example_paged_kv(method, 8, 128, torch.bfloat16)

    def folds(batch, tokens):
        tables = torch.zeros(batch, tokens // 128, dtype=torch.int32)
        return folds_max(torch.zeros(batch, 32, 128, dtype=torch.bfloat16),
                         dataclasses.replace(kv, k_table=tables, v_table=tables), 132)
    shapes = [(1, 4096), (8, 4096), (64, 4096), (1, 32768), (8, 32768), (16, 32768), (32, 32768), (32, 16384),
              (64, 16384), (64, 32768), (128, 32768)]
    assert [s for s in shapes if folds(*s)] == [(16, 32768), (32, 32768), (32, 16384), (64, 16384), (64, 32768),
                                                (128, 32768)]
    # ... and adds q-rows for kitty-pro's 32 boosted channels from 64 pages a program (reads_rows): faster at 85 (64 /
    # 32K), equal at 43, slower for kitty's 16 (BENCHMARKS.md section 1, session 39)
    tables = torch.zeros(64, 256, dtype=torch.int32)
    rows = reads_rows(torch.zeros(64, 32, 128, dtype=torch.bfloat16),
                      dataclasses.replace(kv, k_table=tables, v_table=tables), 132)
    assert rows == (method == "kitty-pro") and check_kernel(ROWS_KERNEL).endswith("+q-rows")
    # ... on a device whose memory reads at least ROWS_MIN_GBS: on an H100 SXM (2,619 MHz, 5,120 bits: 3,352 GB/s)
    # it was slower at 64 / 32K (session 45); a device that does not say keeps it
    assert bandwidth_gbs(2_619_000, 5120) == pytest.approx(3352.3, abs=0.1)
    for gbs in (bandwidth_gbs(2_619_000, 5120), 4800.0, None):
        assert reads_rows(torch.zeros(64, 32, 128, dtype=torch.bfloat16),
                          dataclasses.replace(kv, k_table=tables, v_table=tables), 132, gbs) == (
            rows and (gbs is None or gbs >= ROWS_MIN_GBS))
    assert device_memory_gbs(torch.device("cpu")) is None
    tables = torch.zeros(32, 256, dtype=torch.int32)
    assert not reads_rows(torch.zeros(32, 32, 128, dtype=torch.bfloat16),
                          dataclasses.replace(kv, k_table=tables, v_table=tables), 132)
    assert check_kernel(FOLDED_KERNEL) and kernel_parts(FOLDED_KERNEL) == ("gluon-tma", ("zq-ahead", "fold-max"))


def test_merge_blocks_split_channels_only_while_rows_are_few():
    assert merge_blocks(64 * 32, 128, 132, 12) == (16, 128)      # batch 64 of Qwen3-8B: one program per row
    assert merge_blocks(32, 128, 132, 41) == (64, 32)            # batch 1 / 4K: 4 programs per row, one step
    assert merge_blocks(32, 128, 132, 136) == (256, 8)           # batch 1 / 32K: 16 programs per row, one step
    assert merge_blocks(32, 128, 132, 1000) == (256, 8)          # at most 256 parts a step
    assert merge_blocks(6, 64, 1, 20) == (32, 64) and merge_blocks(6, 64, 100, 20) == (64, 32)


def test_rest_blocks_reach_only_the_tokens_the_buffers_can_hold():
    """The remaining blocks' programs a sequence: the sink's, then T-token blocks over at most capacity - sink
    tokens from a slot boundary. Kitty-pro (sink 32, pages of 128, value window 128) with the paper's schedule: 1 + 8;
    with 12 tokens waiting (flush_spread 13) one block more, not a page's 4; pages of 48 take blocks of 32 (two a
    page, the second half empty)."""
    assert rest_blocks(128, 32, 32 + 128 + 128) == 9
    assert rest_blocks(128, 32, 32 + 128 + 128 + 12) == 10
    assert rest_blocks(48, 8, 8 + 100) == 1 + 2 * 2 + 1 and rest_blocks(48, 8, 8 + 96) == 1 + 2 * 2
    assert rest_blocks(16, 4, 4 + 16 + 16 + 2) == 1 + 2 + 1


def test_rest_warps_follow_the_launch_size():
    assert rest_warps(8 * 9, 132) == 4 and rest_warps(132, 132) == 4       # batch 1 of Qwen3-8B's kitty-pro
    assert rest_warps(8 * 8 * 9, 132) == 2 and rest_warps(133, 132) == 2


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sm_count", [1, 1000])
@pytest.mark.parametrize("parts", [151, 600])                   # one step; three steps of 256
def test_merge_of_many_parts_is_the_log_sum_exp_merge(d, sm_count, parts):
    """All parts in one step, or more parts than the merge reads per step, empty ones (m = -inf) among them, a whole
    step of empty parts first and the largest maximum in a later step: the running rescale equals the one-shot
    merge."""
    gen = torch.Generator().manual_seed(d)
    bsz, hq = 2, 3
    block_s = merge_blocks(bsz * hq, d, sm_count, parts)[0]
    assert block_s >= parts if parts < 256 else parts > 2 * block_s       # the running rescale is exercised
    part_o = torch.randn(bsz, hq, parts, d, generator=gen)
    part_m = torch.randn(bsz, hq, parts, generator=gen) * 4
    part_l = torch.rand(bsz, hq, parts, generator=gen) + 0.5
    part_m[:, :, :parts // 2] = float("-inf")
    part_m[:, :, torch.randperm(parts, generator=gen)[:parts // 3]] = float("-inf")
    part_m[0, 1, -1] = 30.0                                            # one part dominates, in the last step
    w = torch.exp2(part_m - part_m.amax(-1, keepdim=True))
    want = (part_o * w[..., None]).sum(2) / (part_l * w).sum(-1, keepdim=True)
    out = torch.empty(bsz, hq, d, device=DEVICE)
    got = merge_splits(*(t.to(DEVICE) for t in (part_o, part_m, part_l)), out, sm_count=sm_count)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["fp16", "kivi-k4v4", "kitty-pro"])
def test_decode_attention_reads_the_caches_own_layout(method):
    """The kernel on a PagedKV built by the cache itself (page tables exactly as wide as needed, none at all for
    16-bit keys and values), for a ragged batch: equal to the reference."""
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(2, 2, 300, 64, generator=gen).half().to(DEVICE) for _ in range(2))
    layer = KittyLayer(method_config(method), use_triton=False)
    layer.lazy_initialization(k, v)
    layer._append(k, v, np.array([300, 161]))
    kv = layer.paged()
    q = torch.randn(2, 8, 64, generator=gen).half().to(DEVICE)
    assert rel_err(decode_attention(q, kv, 0.125), decode_attention_ref(q, kv, 0.125)) < 2e-3


def test_workspace_is_reused_across_steps_and_changes_nothing():
    """A decode step with a workspace allocates nothing new: same buffers, same results as without one."""
    kv, _, _ = random_paged_kv([150, 71], heads=2, head_dim=64, n_boost=8, seed=3, device=DEVICE)
    q1, q2 = (torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(s)).half().to(DEVICE) for s in (1, 2))
    workspace = DecodeWorkspace()
    out1 = decode_attention(q1, kv, 0.125, num_splits=3, workspace=workspace)
    expected1 = out1.clone()
    buffers = [t.data_ptr() for t in workspace.buffers]
    out2 = decode_attention(q2, kv, 0.125, num_splits=3, workspace=workspace)
    assert [t.data_ptr() for t in workspace.buffers] == buffers and out2.data_ptr() == out1.data_ptr()
    torch.testing.assert_close(out2, decode_attention(q2, kv, 0.125, num_splits=3), atol=0, rtol=0)
    torch.testing.assert_close(expected1, decode_attention(q1, kv, 0.125, num_splits=3), atol=0, rtol=0)
    decode_attention(q1, kv, 0.125, num_splits=4, workspace=workspace)         # another split count: new buffers
    blocks = rest_blocks_per_program(2 * 2, rest_parts(kv), multiprocessors(q1.device), kv.k_table.shape[1])
    assert workspace.buffers[0].shape[2] == 4 + rest_parts(kv, blocks)         # + the remaining blocks' programs


def test_workspace_keeps_tma_descriptors_until_a_page_tensor_moves():
    """The TMA path's descriptors (built on the host, CPU-only here) are made once per layer, not per step: the
    same objects while the pages stay where they are, new ones equal to freshly made ones after a pool moves."""
    from kernels import decode_gluon
    kv, _, _ = random_paged_kv([300, 131], heads=2, head_dim=128, n_boost=32, dtype=torch.bfloat16, seed=4)
    workspace = DecodeWorkspace()

    def described(descriptors):
        return [(d.base.data_ptr(), tuple(d.shape), tuple(d.strides), tuple(d.block_shape)) for d in descriptors]

    first = workspace.tma_descriptors(kv, 128)
    assert described(first) == described(decode_gluon.tma_descriptors(kv, 128))
    assert all(a is b for a, b in zip(workspace.tma_descriptors(kv, 128), first))
    grown = dataclasses.replace(kv, v_scale=torch.cat([kv.v_scale, kv.v_scale]))     # a pool reallocated
    moved = workspace.tma_descriptors(grown, 128)
    assert moved[7] is not first[7] and described(moved) == described(decode_gluon.tma_descriptors(grown, 128))
    assert moved[7].shape[0] == 2 * first[7].shape[0]


def test_reference_attention_is_plain_attention_for_full_precision():
    """The reference itself, checked against textbook attention on the raw keys / values (16-bit cache)."""
    kv, keys, values = random_paged_kv([70, 131], heads=2, head_dim=64, sink=0, k_bits=16, v_bits=16,
                                       dtype=torch.float32)
    q = torch.randn(2, 6, 64)
    out = decode_attention_ref(q, kv, 0.125)
    for b in range(2):
        k = keys[b].repeat_interleave(3, dim=0)
        v = values[b].repeat_interleave(3, dim=0)
        expected = torch.softmax(q[b].unsqueeze(1) @ k.transpose(1, 2) * 0.125, dim=-1) @ v
        torch.testing.assert_close(out[b], expected[:, 0], atol=1e-5, rtol=1e-5)


def test_gather_kv_puts_every_token_in_order():
    """Sink and buffers come back exactly, pages within half a quantization step: token order is right."""
    kv, keys, values = random_paged_kv([300, 45], heads=2, head_dim=64, sink=32, page_size=64, window=64,
                                       n_boost=8, dtype=torch.float32)
    for b, length in enumerate([300, 45]):
        k, v = gather_kv(kv, b, torch.float32)
        assert k.shape == (2, length, 64) and v.shape == (2, length, 64)
        nkp, nvp = int(kv.n_kpages[b]), int(kv.n_vpages[b])
        k_q = slice(32, 32 + 64 * nkp)
        v_q = slice(32, 32 + 64 * nvp)
        assert torch.equal(k[:, :32], keys[b][:, :32]) and torch.equal(k[:, k_q.stop:], keys[b][:, k_q.stop:])
        assert torch.equal(v[:, v_q.stop:], values[b][:, v_q.stop:])
        if nkp:
            spread = keys[b][:, k_q].amax(1) - keys[b][:, k_q].amin(1)          # loose bound: range / 3 / 2
            assert ((k[:, k_q] - keys[b][:, k_q]).abs() <= spread.unsqueeze(1) / 6 + 1e-2).all()
            assert not torch.equal(k[:, k_q], keys[b][:, k_q])                 # really quantized


def test_sass_profile_compiles_the_decode_kernel_for_hopper_without_a_gpu():
    """`python -m kernels.sass_profile` compiles the real kernel for sm_90 and reads its SASS: the counts are
    those of a working kernel (matrix instructions, registers within the 255 limit) and of its loop over paged
    blocks, which holds its products, with --opcodes every opcode of that loop, with --blocks its basic blocks
    (address, instructions, branch targets: a loop of them, back to its first) and with --listing its instructions,
    one a line, from the loop's first address to its branch back; interpreted mode is refused."""
    cmd = [sys.executable, "-m", "kernels.sass_profile", "--method", "kivi-k2v2", "--dtype", "fp16"]
    run = subprocess.run(cmd + ["--opcodes", "--blocks", "--listing"], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    row, opcodes, blocks, *listing = run.stdout.splitlines()
    counts = {k: int(v) for k, v in re.findall(r"([a-z][a-z .\-/]*?) (\d+)", row.split(":", 1)[1])}
    loop = {op: int(n) for op, n in re.findall(r"([A-Z][A-Z0-9_]*) (\d+)", opcodes.split(":", 1)[1])}
    assert sum(loop.values()) == counts["loop instructions"] and loop["HMMA"] == counts["loop matrix"], run.stdout
    pieces = re.findall(r"(0x[0-9a-f]+) (\d+)(?: -> ([?0-9a-fx ]+))?", blocks.split(":", 1)[1])
    assert sum(int(n) for _, n, _ in pieces) == counts["loop instructions"], run.stdout
    assert pieces[-1][2].split()[-1] == "?" + pieces[0][0], run.stdout           # the branch back to the loop's top
    from kernels.sass_profile import INSTRUCTION
    listed = collections.Counter(INSTRUCTION.match(line).group(1) for line in listing)
    assert listed == loop, run.stdout                                      # every instruction of the loop, once
    assert listing[0].split()[0] == f"/*{pieces[0][0][2:]}*/" and "BRA" in listing[-1], listing[:1] + listing[-1:]
    assert 0 < counts["registers"] <= 255 and counts["matrix"] > 0 and counts["instructions"] > 100, run.stdout
    # the loop over paged blocks: part of the kernel, with its matrix products and pipelined page loads
    assert 100 < counts["loop instructions"] < counts["instructions"], run.stdout
    assert 0 < counts["loop matrix"] <= counts["matrix"] and counts["loop cp.async"] > 0, run.stdout
    refused = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert refused.returncode == 2 and "TRITON_INTERPRET=0" in refused.stderr


def test_no_jit_function_goes_on_after_a_branch_that_returns():
    """Triton's and Gluon's compilers build the statements after an `if` whose branch returns, even where the branch
    is taken at compile time: code there must compile for shapes it is never meant for (layout.in_order's other
    axis did not, for pages under 16 tokens, and only on a GPU: the interpreter runs Python). So every such `if`
    in kernels/ has an `else` holding the rest."""
    import ast

    def goes_on(body):
        for i, node in enumerate(body):
            if isinstance(node, ast.If):
                if node.body and isinstance(node.body[-1], ast.Return) and not node.orelse and i + 1 < len(body):
                    yield node.lineno
                yield from goes_on(node.body)
                yield from goes_on(node.orelse)
            elif isinstance(node, (ast.For, ast.While, ast.With)):
                yield from goes_on(node.body)

    found = []
    for path in sorted(Path(__file__).resolve().parents[1].glob("kernels/*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
                found += [f"{path.name}:{line} {fn.name}" for line in goes_on(fn.body)]
    assert not found, found
    assert list(goes_on(ast.parse("if A:\n    return 1\nx = 2").body)) == [1]        # what the scan finds


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every kernel is compiled for real by the other tests")
def test_every_kernel_a_cache_launches_compiles_for_a_gpu_at_pages_under_16_tokens():
    """Here the kernels run in Triton's interpreter, which runs a jit function as Python: kernels.compile_check
    records the launches of caches (kitty-pro, kivi-k4v4 and the query-aware kitty-q; bfloat16 and float32 models)
    at pages of 4 and 8 tokens and compiles each for sm_90. At those sizes a key tile has 1 or 2 rows, and a reshape
    that layout.in_order built after a returning branch broke every such cache on a GPU (session 37); the tool
    reports that tree's quantize, flush and page-reading kernels as failed."""
    cmd = [sys.executable, "-m", "kernels.compile_check", "--page-sizes", "4", "8", "--methods", "kitty-pro",
           "kivi-k4v4", "kitty-q", "--dtypes", "bfloat16", "float32"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = set(re.findall(r"^ok +(\w+) \(", run.stdout, re.M))
    assert {"_quantize_keys_kernel", "_quantize_values_kernel", "_flush_keys_kernel", "_flush_values_kernel",
            "_key_pages_into_kernel", "_channel_error_kernel", "_decode_split_kernel", "_rest_kernel",
            "_merge_splits_kernel", "_chunk_attention_kernel"} <= compiled, compiled
    assert re.search(r"^\d+ launches, 0 failed to compile for sm_90$", run.stdout, re.M), run.stdout[-500:]


def test_remaining_blocks_fit_beside_the_paged_programs():
    """The remaining blocks' kernel compiled for sm_90 (`python -m kernels.sass_profile --kernel rest`, kitty-pro,
    Qwen3-8B's shape, 2 warps) takes 12 KB of shared memory a program with one block (13 KB with its loop over
    several): a version that loaded the 16-bit rows as operands took 20 KB, and with it beside the paged kernel by
    PDL the H200 measured calls up to 7 us slower at batches 1 and 8 (BENCHMARKS.md section 1, session 28). One block a
    program also compiles without the loop: under 160 registers a thread, as the paged programs leave room for. With
    the loop at a cap of 168 registers (decode_rest.rest_maxnreg, the default for 3 blocks a program or more), no
    spills in the loop (triton 3.7.1 keeps one value outside it on the stack, 3.6 none)."""
    rows = {}
    for blocks, cap in ((1, None), (8, None), (8, 168)):
        cmd = [sys.executable, "-m", "kernels.sass_profile", "--kernel", "rest", "--method", "kitty-pro", "--warps",
               "2", "--rest-blocks", str(blocks), *(["--maxnreg", str(cap)] if cap else [])]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"},
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        rows[blocks, cap] = {k: int(v) for k, v in re.findall(r"([a-z][a-z .\-/]*?) (\d+)",
                                                               run.stdout.split(":", 1)[1])}
    one, loop, capped = rows[1, None], rows[8, None], rows[8, 168]
    assert one["shared bytes"] <= 12288 and loop["shared bytes"] <= 13312, rows
    assert one["registers"] < 160 and one["registers"] < loop["registers"], rows
    assert one["local ld/st"] == loop["local ld/st"] == 0, rows
    assert capped["registers"] <= 168 < loop["registers"] and capped["loop local ld/st"] == 0, rows


@pytest.mark.parametrize("g,d", [(36, 64), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_error_kernel_matches_reference_and_the_stored_page(g, d, dtype):
    """The per-channel 2-bit error the query-aware choice weighs: Triton = reference (up to float32 summation
    order), and both equal the error of the page the cache stores at 2 bits, read back."""
    x = random_keys(2, 2, g, d, dtype, seed=3 * g + d)
    ref = channel_error_ref(x)
    assert ref.shape == (2, 2, d) and ref.dtype == torch.float32
    assert torch.allclose(channel_error(x), ref, rtol=1e-5, atol=1e-7 * ref.max().item())
    none = torch.empty((2, 2, 0), dtype=torch.uint8, device=x.device)
    low, high, scale, zero = quantize_keys_ref(x, none, 0)
    stored = dequantize_keys_ref(low, high, none, scale, zero, torch.float32)
    assert torch.allclose((stored - x.float()).square().mean(2), ref, rtol=1e-6, atol=1e-9)
    assert (ref[..., 3] == 0).all()                                          # a constant channel is exact


@pytest.mark.parametrize("g,d", [(36, 64), (64, 128)])
@pytest.mark.parametrize("nb", [1, 8, 16, 32])
def test_query_aware_choice_is_the_same_on_both_paths_and_follows_the_queries(g, d, nb):
    x = random_keys(2, 3, g, d, torch.float16, seed=nb + d)
    energy = torch.rand(2, 3, d, generator=torch.Generator().manual_seed(nb), dtype=torch.float64).to(DEVICE)
    ch, _ = choose_boost(x, nb, "query", query_energy=energy)
    assert ch.shape == (2, 3, nb) and ch.dtype == torch.uint8 and (ch[..., 1:] > ch[..., :-1]).all()
    assert torch.equal(choose_boost(x, nb, "query", query_energy=energy, use_triton=True)[0], ch)
    assert torch.equal(ch.long(), (energy * channel_error_ref(x)).topk(nb).indices.sort().values)
    # queries that read only channel 9 make it a boosted channel in every page and head
    focused = torch.full_like(energy, 1e-9)
    focused[..., 9] = 1.0
    assert boost_mask(choose_boost(x, nb, "query", query_energy=focused)[0], d)[..., 9].all()
    with pytest.raises(ValueError, match="query_energy"):
        choose_boost(x, nb, "query")
