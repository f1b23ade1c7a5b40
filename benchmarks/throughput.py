"""Offline throughput: pagedllm vs HF transformers static batching (and vLLM's CPU build if given).

Workload: N requests, prompt lengths uniform in [64, 512] (random token ids), output lengths
uniform in [32, 256], greedy, ignore_eos. Throughput = (prompt + requested output tokens) / wall
time of the generate call; model load and a warm-up excluded.

    python benchmarks/throughput.py --model llama-100m --dtype bfloat16 --engines pagedllm,hf
    python benchmarks/throughput.py --vllm-python /path/to/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_info, ensure_model, print_table, random_workload, write_json  # noqa: E402


def run_pagedllm(path, reqs, dtype, args) -> float:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, kv_cache_memory=int(args.kv_cache_gib * 2**30), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, skip_tokenizer_init=True,
              tensor_parallel_size=args.tensor_parallel_size, cpu_kv_cache_prefault=args.kv_cache_prefault,
              pipeline_parallel_size=args.pipeline_parallel_size, device=args.device)
    warm = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    llm.generate(prompt_token_ids=[reqs[0][0]], sampling_params=warm, use_tqdm=False)
    sps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in reqs], sampling_params=sps, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, reqs))
    llm.engine.shutdown()
    return dt


def run_hf(path, reqs, dtype, batch_size, device="cpu") -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()

    def batch_generate(batch):
        L = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        new = max(o for _, o in batch)  # a static batch runs until its longest output is done
        with torch.no_grad():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, eos_token_id=None)

    batch_generate(reqs[:1][:1] and [(reqs[0][0], 4)])
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch_generate(reqs[i:i + batch_size])
    if device != "cpu":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return dt


VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], skip_tokenizer_init=True, seed=0)
    reqs = cfg["reqs"]
    llm.generate([{"prompt_token_ids": reqs[0][0]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sps = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in reqs]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sps, use_tqdm=False)
    print("ELAPSED", time.perf_counter() - t)
if __name__ == "__main__":
    main()
"""


def run_vllm(python, path, reqs, dtype) -> float:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "cfg.json")
        script = os.path.join(d, "run_vllm.py")
        json.dump({"model": path, "dtype": dtype, "reqs": reqs}, open(cfg, "w"))
        open(script, "w").write(VLLM_SCRIPT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1")
        out = subprocess.run([python, script, cfg], capture_output=True, text=True, env=env)
        for line in out.stdout.splitlines():
            if line.startswith("ELAPSED"):
                return float(line.split()[1])
        raise RuntimeError(f"vLLM run failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-100m", help="llama-tiny | llama-100m | a checkpoint path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="pagedllm,hf")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--kv-cache-prefault", action="store_true",
                    help="fault the KV cache in at start-up (EngineConfig.cpu_kv_cache_prefault), as vLLM's "
                         "torch.zeros cache is: the run then pays no first-touch cost")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: both engines run there (HF moved with .to)")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    reqs = random_workload(args.num_requests, args.seed)
    total_prompt = sum(len(p) for p, _ in reqs)
    total_out = sum(o for _, o in reqs)
    engines = [e for e in args.engines.split(",") if e]
    if args.vllm_python and "vllm" not in engines:
        engines.append("vllm")
    rows = []
    for eng in engines:
        if eng == "pagedllm":
            dt = run_pagedllm(path, reqs, args.dtype, args)
        elif eng == "hf":
            dt = run_hf(path, reqs, args.dtype, args.hf_batch_size, args.device)
            eng = f"hf-static-b{args.hf_batch_size}"
        elif eng == "vllm":
            dt = run_vllm(args.vllm_python, path, reqs, args.dtype)
        else:
            raise SystemExit(f"unknown engine {eng}")
        rows.append({"engine": eng, "seconds": round(dt, 2), "total_tok_s": round((total_prompt + total_out) / dt, 1),
                     "output_tok_s": round(total_out / dt, 1)})
        print(f"{eng}: {dt:.2f}s", flush=True)
    base = next((r for r in rows if r["engine"].startswith("hf")), None)
    for r in rows:
        if base:
            r["vs_hf"] = round(r["total_tok_s"] / base["total_tok_s"], 2)
    from pagedllm.worker.cpu_threads import decide_cpu_threads, read_cpu_facts

    threads = decide_cpu_threads(read_cpu_facts(), env=os.environ).as_dict()  # cores seen, quota, threads, why
    print(f"\nmodel={args.model} dtype={args.dtype} requests={len(reqs)} prompt_tokens={total_prompt} output_tokens={total_out}"
          f"\nCPU threads: {threads}")
    print_table(rows, ["engine", "seconds", "total_tok_s", "output_tok_s", "vs_hf"])
    write_json(args.out, {"model": args.model, "dtype": args.dtype, "num_requests": len(reqs), "prompt_tokens": total_prompt,
                          "output_tokens": total_out, "results": rows, "device": device_info(args.device),
                          "cpu_threads": threads, "argv": sys.argv})


if __name__ == "__main__":
    main()
