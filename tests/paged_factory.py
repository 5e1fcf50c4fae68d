"""Random PagedKV caches for kernel tests, built independently of backend/ (pages scattered in a shuffled pool)."""
from __future__ import annotations

import torch

from kernels.layout import PagedKV, key_plane_shape, value_plane_shape
from kernels.quantize import choose_boost, quantize_keys_ref, quantize_values_ref


def random_paged_kv(lengths, heads=2, head_dim=64, sink=32, page_size=64, window=64, k_bits=2, v_bits=2,
                    n_boost=8, dtype=torch.float16, seed=0, device="cpu"):
    """A cache holding random keys/values for sequences of the given lengths, laid out as the cache lays them."""
    gen = torch.Generator().manual_seed(seed)
    bsz, g, d, h = len(lengths), page_size, head_dim, heads
    layouts = []
    for length in lengths:
        n = max(0, length - sink)
        nkp = n // g if k_bits < 16 else 0
        nvp = max(0, n - window) // g if v_bits < 16 else 0
        layouts.append((length, nkp, nvp))
    ck = max(1, sink + max(length - min(length, sink) - nkp * g for length, nkp, _ in layouts))
    cv = max(1, sink + max(length - min(length, sink) - nvp * g for length, _, nvp in layouts))
    # Keys with a few loud channels, as real keys have (the boost has something to find)
    loud = torch.rand(h, 1, d, generator=gen) * 4 + 0.25
    keys = [(torch.randn(h, length, d, generator=gen) * loud).to(dtype) for length, _, _ in layouts]
    values = [torch.randn(h, length, d, generator=gen).to(dtype) for length, _, _ in layouts]

    k_fp = torch.randn(bsz, h, ck, d, generator=gen).to(dtype)   # junk beyond the valid tokens on purpose
    v_fp = torch.randn(bsz, h, cv, d, generator=gen).to(dtype)
    total_k = sum(nkp for _, nkp, _ in layouts) + 1
    total_v = sum(nvp for _, _, nvp in layouts) + 1
    k_ids = torch.randperm(total_k, generator=gen)
    v_ids = torch.randperm(total_v, generator=gen)
    nb = d if k_bits == 4 else (n_boost if k_bits == 2 else 0)
    k_low = torch.randint(0, 256, (total_k, *key_plane_shape(h, g, d)), generator=gen, dtype=torch.uint8)
    k_high = torch.randint(0, 256, (total_k, *key_plane_shape(h, g, nb)), generator=gen, dtype=torch.uint8)
    k_ch = torch.randint(0, 256, (total_k, h, nb), generator=gen, dtype=torch.uint8)   # junk in unused pages
    k_scale = torch.rand(total_k, h, d, generator=gen).half()
    k_zero = torch.rand(total_k, h, d, generator=gen).half()
    v_low = torch.randint(0, 256, (total_v, *value_plane_shape(h, d, g)), generator=gen, dtype=torch.uint8)
    v_high = torch.randint(0, 256, (total_v, *value_plane_shape(h, d, g, v_bits == 4)), generator=gen,
                           dtype=torch.uint8)
    v_scale = torch.rand(total_v, h, g, generator=gen).half()
    v_zero = torch.rand(total_v, h, g, generator=gen).half()
    # tables of different widths (as the cache grows them independently), padded with -1
    k_table = torch.full((bsz, max(1, max(x[1] for x in layouts))), -1, dtype=torch.int32)
    v_table = torch.full((bsz, max(1, max(x[2] for x in layouts)) + 3), -1, dtype=torch.int32)
    kpos = vpos = 0
    for b, (length, nkp, nvp) in enumerate(layouts):
        sk = min(length, sink)
        k_fp[b, :, :sk], v_fp[b, :, :sk] = keys[b][:, :sk], values[b][:, :sk]
        for p in range(nkp):
            x = keys[b][:, sink + p * g: sink + (p + 1) * g].unsqueeze(0)
            ch, _ = choose_boost(x, nb)
            pid = int(k_ids[kpos]); kpos += 1
            k_table[b, p] = pid
            k_ch[pid] = ch[0]
            k_low[pid], k_high[pid], k_scale[pid], k_zero[pid] = (t[0] for t in quantize_keys_ref(x, ch, nb))
        for p in range(nvp):
            x = values[b][:, sink + p * g: sink + (p + 1) * g].unsqueeze(0)
            pid = int(v_ids[vpos]); vpos += 1
            v_table[b, p] = pid
            v_low[pid], v_high[pid], v_scale[pid], v_zero[pid] = (t[0] for t in quantize_values_ref(x, v_bits))
        kt = keys[b][:, sink + nkp * g:]
        vt = values[b][:, sink + nvp * g:]
        k_fp[b, :, sink:sink + kt.shape[1]] = kt
        v_fp[b, :, sink:sink + vt.shape[1]] = vt
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    kv = PagedKV(k_fp, v_fp, k_low, k_high, k_ch, k_scale, k_zero, v_low, v_high, v_scale, v_zero, k_table,
                 v_table, as_i32([x[0] for x in layouts]), as_i32([x[1] for x in layouts]),
                 as_i32([x[2] for x in layouts]), sink, g, nb, v_bits)
    if device != "cpu":
        kv = PagedKV(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in kv.__dict__.values()))
    return kv, keys, values
