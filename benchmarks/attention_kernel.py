"""Micro-benchmark of the Triton paged-attention kernel (pagedllm/attention/triton_attn.py).

Decode cases report achieved HBM bandwidth = bytes of K/V read / kernel time (H200 peak is
~4.8 TB/s); prefill cases report attention TFLOP/s. Needs CUDA; exits 0 with a message otherwise.

    python benchmarks/attention_kernel.py [--dtype bf16] [--block-size 16] [--quick]
        [--kv-cache-dtype auto|int8|fp8_e4m3|fp8_e5m2]   (8-bit: bytes read include the bf16 scales)
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(seq_lens, q_lens, num_kv_heads, head_dim, block_size, dtype, device, kv_cache_dtype="auto"):
    """Random cache + metadata. Blocks are handed out in a shuffled order (realistic paging)."""
    from pagedllm.attention.backend import AttentionMetadata

    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    q_lens = np.asarray(q_lens, dtype=np.int32)
    blocks_per = (seq_lens + block_size - 1) // block_size
    num_blocks = int(blocks_per.sum())
    perm = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    max_blocks = int(blocks_per.max())
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)
    off = 0
    slot_chunks = []
    for i, nb in enumerate(blocks_per.tolist()):  # setup only, not timed
        blks = perm[off : off + nb]
        block_table[i, :nb] = blks
        off += nb
        pos = torch.arange(int(seq_lens[i]) - int(q_lens[i]), int(seq_lens[i]), device=device)
        slot_chunks.append(blks.long()[pos // block_size] * block_size + pos % block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    if kv_cache_dtype != "auto":  # 8-bit values + one scale per (token, kv head), kv_quant.py's layout
        from pagedllm.attention import kv_quant

        q, scales = kv_quant.quantize(kv_cache, kv_quant.kv_quant(kv_cache_dtype))
        kv_cache = (q, scales)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        num_actual_tokens=int(q_lens.sum()),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=block_table,
        slot_mapping=torch.cat(slot_chunks),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return kv_cache, md


def bench_case(name, seq_lens, q_lens, args, num_splits=None, num_heads=32, num_kv_heads=8, head_dim=128):
    import triton

    from pagedllm.attention.triton_attn import choose_num_splits, unified_attention

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    kv_cache, md = build(seq_lens, q_lens, num_kv_heads, head_dim, args.block_size, dtype, device, args.kv_cache_dtype)
    kv_scales = None
    if isinstance(kv_cache, tuple):
        kv_cache, kv_scales = kv_cache
    n = md.num_actual_tokens
    query = torch.randn(n, num_heads, head_dim, device=device).to(dtype)
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    def fn():
        unified_attention(
            query, kv_cache, out, md.query_start_loc, md.seq_lens, md.block_table,
            num_tokens=n, num_reqs=md.num_reqs, max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len, scale=scale, num_splits=num_splits, kv_scales=kv_scales,
        )

    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep)
    row_bytes = head_dim * kv_cache.element_size() + (0 if kv_scales is None else kv_scales.element_size())
    kv_bytes = int(np.sum(md.seq_lens_cpu)) * num_kv_heads * 2 * row_bytes
    q_lens_np = np.asarray(q_lens)
    seq_np = np.asarray(seq_lens)
    ctx = seq_np - q_lens_np
    # causal pairs: sum over rows of (ctx + r + 1)
    pairs = float(np.sum(q_lens_np * ctx + q_lens_np * (q_lens_np + 1) / 2))
    flops = 4.0 * pairs * num_heads * head_dim
    splits = num_splits
    if splits is None:
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        splits = choose_num_splits(md.num_reqs, num_kv_heads, md.max_query_len, md.max_seq_len, sm)
    print(
        f"{name:<44} splits={splits:<3d} {ms * 1e3:9.1f} us   "
        f"KV {kv_bytes / 1e6:8.1f} MB -> {kv_bytes / (ms * 1e-3) / 1e12:6.2f} TB/s   "
        f"{flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s",
        flush=True,
    )
    return ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rep", type=int, default=100, help="ms of timed repetitions per case")
    p.add_argument("--quick", action="store_true", help="only the headline decode case")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("attention_kernel.py: CUDA not available, skipping the Triton attention benchmark")
        return 0
    try:
        import triton
    except ImportError:
        print("attention_kernel.py: triton not installed, skipping")
        return 0

    torch.manual_seed(0)
    print(
        f"device={torch.cuda.get_device_name(0)} torch={torch.__version__} triton={triton.__version__} "
        f"dtype={args.dtype} kv_cache_dtype={args.kv_cache_dtype} block_size={args.block_size} heads=32 kv_heads=8 "
        "head_dim=128"
    )
    bench_case("decode 64 seqs x 4096", [4096] * 64, [1] * 64, args)
    if args.quick:
        return 0
    bench_case("decode 256 seqs x 1024", [1024] * 256, [1] * 256, args)
    bench_case("decode 16 seqs x 8192", [8192] * 16, [1] * 16, args)
    bench_case("decode 4 seqs x 32768 (split-KV auto)", [32768] * 4, [1] * 4, args)
    bench_case("decode 4 seqs x 32768 (no split)", [32768] * 4, [1] * 4, args, num_splits=1)
    bench_case("decode 1 seq x 131072 (split-KV auto)", [131072], [1], args)
    bench_case("prefill 4 x 2048 (fresh)", [2048] * 4, [2048] * 4, args)
    bench_case("chunk 2048 @ 2048 prefix + 63 decodes x 4096", [4096] + [4096] * 63, [2048] + [1] * 63, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
