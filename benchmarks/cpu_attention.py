"""Micro-benchmark of the C++ CPU attention kernels (pagedllm/kernels/csrc/paged_*.h).

Decode: B sequences x L cached tokens, one layer, blocks in shuffled order in a KV cache
allocated as the worker allocates it; "resident" reuses one sequence's blocks for every row (the
K/V stay in cache: compute cost alone). Prefill: P fresh prompts of n tokens, causal; GFLOP/s
count the causal triangle (2 * 2 * H * D * n^2 / 2 per prompt).

    python benchmarks/cpu_attention.py [--heads 12 --kv-heads 4 --head-dim 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402

from pagedllm.kernels import cpu as cpu_kernels  # noqa: E402
from pagedllm.worker.cpu_memory import cpu_kv_cache_memory  # noqa: E402


def kv_cache(num_blocks, bs, Hkv, D, dtype):
    esz = torch.empty((), dtype=dtype).element_size()
    kv = cpu_kv_cache_memory(2 * num_blocks * bs * Hkv * D * esz).view(dtype).view(2, num_blocks, bs, Hkv, D)
    kv.copy_(torch.randn(2, num_blocks, bs, Hkv, D))
    return kv


def best_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, float(np.median(times)) * 1e3


def decode_case(mod, B, L, args, dtype, resident):
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-L // bs)
    kv = kv_cache(per_seq if resident else B * per_seq, bs, Hkv, D, dtype)
    if resident:
        table = torch.arange(per_seq, dtype=torch.int32).repeat(B, 1).contiguous()
    else:
        table = torch.randperm(B * per_seq).to(torch.int32).view(B, per_seq).contiguous()
    seq_lens = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, H, D).to(dtype)
    out = torch.empty_like(q)
    best, med = best_ms(lambda: mod.paged_decode_attention(out, q, kv[0], kv[1], table, seq_lens, D**-0.5, 0), args.reps)
    kv_bytes = 2 * B * L * Hkv * D * kv.element_size()
    return {"kernel": "decode" + (" (resident)" if resident else ""), "batch": B, "tokens": L, "best_ms": round(best, 3),
            "median_ms": round(med, 3), "GB/s": round(kv_bytes / best / 1e6, 1), "GFLOP/s": round(4 * B * L * H * D / best / 1e6, 1)}


def prefill_case(mod, P, n, args, dtype):
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-n // bs)
    kv = kv_cache(P * per_seq, bs, Hkv, D, dtype)
    table = torch.randperm(P * per_seq).to(torch.int32).view(P, per_seq).contiguous()
    q = torch.randn(P * n, H, D).to(dtype)
    out = torch.empty_like(q)
    starts = torch.arange(P, dtype=torch.int32) * n
    lens = torch.full((P,), n, dtype=torch.int32)
    best, med = best_ms(
        lambda: mod.paged_prefill_attention(out, q, kv[0], kv[1], table, starts, lens, lens, D**-0.5, 0), args.reps
    )
    flops = P * 2 * 2 * H * D * n * n / 2
    return {"kernel": "prefill", "batch": P, "tokens": n, "best_ms": round(best, 3), "median_ms": round(med, 3),
            "GB/s": "", "GFLOP/s": round(flops / best / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/cpu_attention.json")
    args = ap.parse_args()
    mod = cpu_kernels.load()
    if mod is None:
        print("CPU kernels unavailable (no compiler): nothing to measure")
        return
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    rows = [decode_case(mod, B, L, args, dtype, resident) for B, L, resident in
            [(64, 400, False), (64, 400, True), (8, 400, False), (4, 2000, False)]]
    rows += [prefill_case(mod, P, n, args, dtype) for P, n in [(16, 128), (4, 512), (1, 2000)]]
    print(f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, block {args.block_size}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print_table(rows, list(rows[0]))
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
