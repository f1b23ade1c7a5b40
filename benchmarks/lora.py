"""Multi-LoRA throughput: the same requests on the base model alone, and with LoRA adapters
(rank 16 on every projection: q/k/v/o, gate/up/down) -- 0 adapters (LoRA enabled, every request
on the base), 1 adapter for all, and N adapters round-robin -- in one batch of requests. Runs
alternate back to back and repeat; the best of each is reported (a shared machine is noisy).

    python benchmarks/lora.py --model llama-100m --num-requests 64 --json out.json

Adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors) with
random A and B, into .cache/bench-loras.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CACHE_DIR, ensure_model, print_table, random_workload, write_json  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(model_dir: str, out: str, rank: int, seed: int) -> str:
    """A PEFT-format LoRA adapter with random A and B (B non-zero) on every projection."""
    if os.path.exists(os.path.join(out, "adapter_model.safetensors")):
        return out
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, inter = cfg.get("num_key_value_heads", heads), cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none", "modules_to_save": None, "use_rslora": False}, f)
    return out


def run(llm, workload, loras):
    from pagedllm import SamplingParams

    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, **({"lora_request": loras} if loras is not None else {}))
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return cpu, elapsed, out_tokens, sum(len(p) for p in prompts) + out_tokens


def layer_cost(rows_list, rank: int, num_adapters: int, reps: int = 30) -> list[dict]:
    """One-thread CPU time of one llama-100m layer's four projections (qkv, o, gate_up, down; bf16,
    packed as the engine packs them) with and without the adapters' deltas, best of ``reps``."""
    import numpy as np
    import torch
    from torch import nn

    from pagedllm.distributed.parallel_state import get_tp_group
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.layers.cpu_gemm import pack_linear_weights
    from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from pagedllm.lora.batch import LoRAStepState, build_lora_batch
    from pagedllm.lora.layers import LoRALinear

    torch.set_num_threads(1)
    cpu_kernels.load()
    dt, h, inter = torch.bfloat16, 768, 2048
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    mods = nn.ModuleDict(dict(qkv=QKVParallelLinear(h, 64, 12, 4), o=RowParallelLinear(h, h),
                              gu=ColumnParallelLinear(h, [inter, inter]), d=RowParallelLinear(inter, h)))
    torch.set_default_dtype(prev)
    for m in mods.values():
        m.weight.data.normal_(0, 0.02)
    pack_linear_weights(mods, dt)
    state = LoRAStepState()
    spec = dict(qkv=(3, [768, 256, 256], h, False), o=(1, [h], h, True), gu=(2, [inter, inter], h, False),
                d=(1, [h], inter, True))
    wrapped = {}
    for k, (n, outs, fan_in, row) in spec.items():
        w = LoRALinear(mods[k], tuple(range(n)), outs, fan_in, row, state, num_adapters, rank, get_tp_group(), dt,
                       torch.device("cpu"))
        for s in range(num_adapters):
            w.set_slot(s, rank, {t: (torch.randn(rank, fan_in, dtype=dt) * 0.01, torch.randn(o, rank, dtype=dt) * 0.01)
                                 for t, o in enumerate(outs)})
        wrapped[k] = w
    results = []
    for rows in rows_list:
        x = {k: torch.randn(rows, spec[k][2], dtype=dt) for k in spec}
        cases = {"base": None, "1 adapter": np.zeros(rows, dtype=np.int64),
                 f"{num_adapters} adapters": np.arange(rows) % num_adapters,
                 "half base, 1 adapter": np.where(np.arange(rows) % 2 == 0, 0, -1)}
        row = {"rows": rows}
        for name, slots in cases.items():
            state.batch = None if slots is None else build_lora_batch(slots, torch.device("cpu"))
            layers = mods if slots is None else wrapped
            best = float("inf")
            for _ in range(reps):
                t = time.thread_time()
                for k in spec:
                    layers[k](x[k])
                best = min(best, time.thread_time() - t)
            row[name] = best * 1e3
        state.batch = None
        results.append({"rows": rows, **{k: f"{v:.3f} ms" + ("" if k == "base" else f" ({v / row['base'] - 1:+.0%})")
                                         for k, v in row.items() if k != "rows"}})
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--output-range", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1: the CPU-time figures are the "
                    "robust ones on a shared machine)")
    ap.add_argument("--layer-only", action="store_true", help="time one layer's four projections (one thread, "
                    "CPU time) at 64 and 512 rows instead of the engine runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.layer_only:
        rows = layer_cost((64, 512), args.rank, args.num_adapters)
        print(f"one llama-100m layer's q/k/v, o, gate/up, down products, bf16, rank {args.rank}: one-thread CPU time")
        print_table(rows, list(rows[0]))
        write_json(args.json, {"args": vars(args), "results": rows})
        return
    from pagedllm import LLM
    from pagedllm.lora.request import LoRARequest

    path = ensure_model(args.model)
    adapters = [make_peft_adapter(path, os.path.join(os.path.dirname(CACHE_DIR), "bench-loras",
                                                     f"{args.model}-r{args.rank}-{i}"), args.rank, seed=i)
                for i in range(args.num_adapters)]
    loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(adapters)]
    workload = random_workload(args.num_requests, seed=0, prompt_range=tuple(args.prompt_range),
                               output_range=tuple(args.output_range))
    common = dict(model=path, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=args.num_requests, skip_tokenizer_init=True, cpu_threads=args.threads)
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    n = args.num_requests
    cases = [("base model (no LoRA)", base, None), ("LoRA on, 0 adapters", lora, [None] * n),
             ("1 adapter", lora, [loras[0]] * n),
             (f"{args.num_adapters} adapters", lora, [loras[i % args.num_adapters] for i in range(n)])]
    for _, llm, reqs in cases:  # warm up: kernels, allocator, adapters read into the host cache
        run(llm, workload[:4], None if reqs is None else reqs[:4])
    best: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for name, llm, reqs in cases:
            r = run(llm, workload, reqs)
            if name not in best or r[0] < best[name][0]:
                best[name] = r
    rows = []
    base_cpu, base_wall = best[cases[0][0]][0], best[cases[0][0]][1]
    for name, _, _ in cases:  # the same tokens in every case: time ratios are throughput ratios
        cpu, elapsed, out_tok, all_tok = best[name]
        rows.append({"case": name, "wall s": f"{elapsed:.2f}", "output tok/s": f"{out_tok / elapsed:.0f}",
                     "total tok/s": f"{all_tok / elapsed:.0f}", "cpu s": f"{cpu:.2f}",
                     "cpu-time overhead": f"{(cpu / base_cpu - 1) * 100:+.1f}%",
                     "wall overhead": f"{(elapsed / base_wall - 1) * 100:+.1f}%"})
    print(f"{args.model}, {args.dtype}, {n} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]}, outputs "
          f"{args.output_range[0]}-{args.output_range[1]} tokens, rank {args.rank} on q/k/v/o/gate/up/down, best of "
          f"{args.repeats}")
    print_table(rows, ["case", "wall s", "output tok/s", "total tok/s", "wall overhead", "cpu s", "cpu-time overhead"])
    write_json(args.json, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
