"""MoE layer step time against active and total experts: one SparseMoE layer (Mixtral-shaped:
hidden 512, expert intermediate 1024, bf16 by default) timed on a decode-sized batch and a
prefill-sized one, for several (experts, top-k) pairs. Step time should follow the active
experts (top-k; and how many distinct experts the batch touches), not the total.

    python benchmarks/moe_step.py --dtype bfloat16 --tokens 16,256 --configs 8x1,8x2,16x2,32x2,8x4 --threads 1

Median of --repeat timed calls after warm-up; weights random; experts packed for the CPU GEMM as
the worker packs them (pagedllm's kernels where built).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--tokens", default="16,256")
    ap.add_argument("--configs", default="8x1,8x2,16x2,32x2,8x4", help="experts x top_k, comma separated")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="benchmarks/results/moe_step.json")
    args = ap.parse_args()

    import torch

    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.layers.cpu_gemm import pack_linear_weights
    from pagedllm.layers.moe import RouterConfig, SparseMoE

    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.load()
    rows = []
    for spec in args.configs.split(","):
        experts, top_k = (int(v) for v in spec.split("x"))
        torch.manual_seed(0)
        with torch.device("cpu"):
            layer = SparseMoE(args.hidden, args.intermediate, RouterConfig(experts, top_k)).to(dtype)
        for p in layer.parameters():
            p.data.normal_(0, 0.05)
        pack_linear_weights(layer, dtype)
        layer.experts.pack_for_cpu(dtype)
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, args.hidden, dtype=dtype)
            with torch.inference_mode():
                for _ in range(3):
                    layer(x)
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - t)
                touched = int(layer.gate(x)[1].unique().numel())
            rows.append({"experts": experts, "top_k": top_k, "tokens": T, "experts_touched": touched,
                         "ms": round(1e3 * statistics.median(times), 3)})
            print(rows[-1], flush=True)
    print()
    print_table(rows, ["experts", "top_k", "tokens", "experts_touched", "ms"])
    write_json(args.out, {"dtype": args.dtype, "hidden": args.hidden, "intermediate": args.intermediate,
                          "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
