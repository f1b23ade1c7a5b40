"""The hardware floor of benchmarks/throughput.py's workload on this CPU: how fast any engine that
runs the model op by op could finish it, from the GEMM rate and memory bandwidth measured here.

No engine runs here. The workload is throughput.py's (same seed: N requests, prompts 64-512,
outputs 32-256); the schedule is continuous batching with every request admitted at once, so
decode step k multiplies M_k = #{requests with more than k outputs} rows. Per component:

- linear layers + LM head: model FLOPs of every step at the GEMM rate this CPU reaches for that
  many rows (benchmarks/cpu_gemm.py's JSON for our packed GEMM in the model's dtype, interpolated
  over log rows; weights stream from memory there, as in a decode step). Prompt tokens run at the
  rate of the largest row count measured.
- prefill attention: its FLOPs at the same best rate (generous: real attention kernels are slower).
- decode attention: every decode token reads its sequence's whole K and V once; those bytes over
  the streaming-read bandwidth measured in this run (decode_bandwidth.py's measure).

The sum is a floor for op-by-op execution (no engine overlaps a GEMM with attention on the same
cores); the script prints it beside measured times given with --measured, and the largest speed-up
over another engine that the floor leaves room for.

    python benchmarks/cpu_gemm.py --rounds 5            # writes benchmarks/results/cpu_gemm.json
    python benchmarks/throughput_floor.py --model llama-100m --dtype bfloat16 --measured pagedllm=9.62,vllm=11.49
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, print_table, random_workload, write_json  # noqa: E402
from decode_bandwidth import cpu_flags, stream_bandwidth  # noqa: E402


def gemm_rate(table: list[tuple[int, float]], rows: int) -> float:
    """GFLOP/s at ``rows`` rows: linear in log(rows) between measured points, clamped at the ends."""
    if rows <= table[0][0]:
        return table[0][1]
    for (m0, r0), (m1, r1) in zip(table, table[1:]):
        if rows <= m1:
            f = (math.log(rows) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return r0 + f * (r1 - r0)
    return table[-1][1]


def floor_seconds(shape: dict, reqs: list, gemm: list[tuple[int, float]], bandwidth: float, elt: int,
                  vocab: int = 32000) -> dict:
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = H // heads
    linear_params = L * (H * (H + 2 * kvh * hd) + H * H + 3 * H * I)
    head_flops = 2 * vocab * H
    per_token = 2 * linear_params
    best = max(r for _, r in gemm)

    prompt_tokens = sum(len(p) for p, _ in reqs)
    # Prefill: every prompt token through the linear layers, one LM-head row per request.
    t_prefill = prompt_tokens * per_token / (best * 1e9) + len(reqs) * head_flops / (best * 1e9)
    # Decode step k (k = 1 .. max outputs - 1): M_k rows through the layers and the head.
    outs = [o for _, o in reqs]
    t_decode, decode_tokens = 0.0, 0
    for k in range(1, max(outs)):
        m = sum(1 for o in outs if o > k)
        decode_tokens += m
        t_decode += m * (per_token + head_flops) / (gemm_rate(gemm, m) * 1e9)
    # Attention: prefill FLOPs (causal pairs x heads x 4 x head_dim) at the best rate; decode bytes.
    pairs = sum(len(p) * (len(p) + 1) / 2 for p, _ in reqs)
    t_prefill_attn = 4 * pairs * heads * hd * L / (best * 1e9)
    kv_per_token = L * 2 * kvh * hd * elt
    kv_bytes = sum(sum(len(p) + j for j in range(1, o)) for p, o in reqs) * kv_per_token
    t_kv = kv_bytes / bandwidth
    return {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
            "linear_prefill_s": t_prefill, "linear_decode_s": t_decode, "prefill_attention_s": t_prefill_attn,
            "decode_kv_GB": kv_bytes / 1e9, "decode_attention_s": t_kv,
            "floor_s": t_prefill + t_decode + t_prefill_attn + t_kv,
            "model_flop": prompt_tokens * per_token + decode_tokens * per_token + sum(outs) * head_flops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-100m", choices=[m for m in MODELS if "arch" not in MODELS[m]])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemm-json", default="benchmarks/results/cpu_gemm.json",
                    help="benchmarks/cpu_gemm.py's output for this model's shapes, measured on this CPU")
    ap.add_argument("--measured", default="", help="engine=seconds,... from throughput.py on the same workload")
    ap.add_argument("--out", default="benchmarks/results/throughput_floor.json")
    args = ap.parse_args()

    try:
        gemm_run = json.load(open(args.gemm_json))
    except OSError:
        raise SystemExit(f"{args.gemm_json} is missing: run `python benchmarks/cpu_gemm.py --rounds 5` first "
                         "(with the model's shapes)")
    shape = MODELS[args.model]
    g = gemm_run["args"]
    if (g["hidden"], g["intermediate"], g["layers"]) != (shape["hidden_size"], shape["intermediate_size"],
                                                         shape["num_hidden_layers"]):
        raise SystemExit(f"{args.gemm_json} was measured for hidden {g['hidden']}, intermediate "
                         f"{g['intermediate']}, {g['layers']} layers; run cpu_gemm.py with {args.model}'s shapes")
    key = "ours bf16 GFLOP/s" if args.dtype == "bfloat16" else "ours f32 GFLOP/s"
    gemm = sorted((r["rows"], r[key]) for r in gemm_run["results"])
    bw = stream_bandwidth()
    reqs = random_workload(args.num_requests, args.seed)
    f = floor_seconds(shape, reqs, gemm, bw, 2 if args.dtype == "bfloat16" else 4)

    rows = [{"component": "linear + LM head, prompts", "seconds": round(f["linear_prefill_s"], 3)},
            {"component": "linear + LM head, decode steps", "seconds": round(f["linear_decode_s"], 3)},
            {"component": "prefill attention (at the best GEMM rate)", "seconds": round(f["prefill_attention_s"], 3)},
            {"component": f"decode K/V reads: {f['decode_kv_GB']:.1f} GB at {bw / 1e9:.1f} GB/s",
             "seconds": round(f["decode_attention_s"], 3)},
            {"component": "floor", "seconds": round(f["floor_s"], 3)}]
    measured = dict((k, float(v)) for k, v in (x.split("=") for x in args.measured.split(",") if x))
    peak_rows, peak = max(gemm, key=lambda r: r[1])
    for eng, sec in measured.items():
        rows.append({"component": f"measured {eng}: {f['floor_s'] / sec:.0%} of the floor's speed; "
                                  f"model FLOP rate {f['model_flop'] / sec / 1e9:.0f} GFLOP/s = "
                                  f"{f['model_flop'] / sec / 1e9 / peak:.0%} of the GEMM peak "
                                  f"{peak:.0f} (at {peak_rows} rows)", "seconds": sec})
    for eng, sec in measured.items():
        rows.append({"component": f"largest speed-up over {eng} the floor allows", "seconds": "",
                     "x": round(sec / f["floor_s"], 2)})
    print(f"model={args.model} dtype={args.dtype} requests={len(reqs)} prompt tokens {f['prompt_tokens']}, decode "
          f"tokens {f['decode_tokens']}; GEMM rates {gemm_run.get('gemm_path')} {gemm}")
    print_table(rows, ["component", "seconds", "x"])
    write_json(args.out, {"model": args.model, "dtype": args.dtype, "stream_read_GBps": round(bw / 1e9, 2),
                          "gemm_rates": gemm, "floor": f, "measured": measured, "cpu": cpu_flags(), "argv": sys.argv})


if __name__ == "__main__":
    main()
