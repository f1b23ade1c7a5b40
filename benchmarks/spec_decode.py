"""Speculative decoding on CPU: decode tok/s with n-gram lookup and a draft model against no
speculation, with the acceptance figures and a cost model that predicts the speed-up.

Target: the embedded default model (models/tiny-shakespeare); draft: the same recipe, smaller
(``python scripts/train_default_model.py --preset draft`` -> models/tiny-shakespeare-draft),
same tokenizer. Workloads (greedy, ignore_eos, fixed max_tokens):
  repetitive  -- a passage from the validation text, then the instruction to repeat it and its
                 first line again: the answer largely copies the prompt (what prompt lookup is for);
  open        -- the first lines of validation passages, continued freely.

For every (workload, batch, method) the same prompts run back to back ``--rounds`` times; the
best round counts (the machine is shared). The cost model: with per-token acceptance a and k
drafts, a drafted step emits E = (1 - a^(k+1)) / (1 - a) tokens per request if acceptances were
independent (``iid_len``; ``mean_len`` is what was measured); a fraction ``drafted`` of the
request-steps had drafts (the others emit 1 token). A plain decode step costs t_plain, a
speculative one t_draft + t_verify (``draft_ms`` is the proposer's share of ``step_ms``).
Predicted speed-up = (drafted * mean_len + 1 - drafted) * t_plain / t_spec, checked against the
measured tok/s ratio (``speedup``; ``cpu_speedup`` is the same from the process's CPU seconds,
steadier on a shared machine with ``--threads 1``).

    python benchmarks/spec_decode.py --batches 1 32 --max-tokens 96 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "models", "tiny-shakespeare")
DRAFT = os.path.join(REPO, "models", "tiny-shakespeare-draft")


def passages(n: int, lines: int = 6) -> list[str]:
    text = open(os.path.join(REPO, "data", "tinyshakespeare.txt"), encoding="utf-8").read()
    val = text[int(0.9 * len(text)):]
    paras = [p for p in val.split("\n\n") if p.count("\n") >= lines - 1]
    return ["\n".join(p.split("\n")[:lines]) for p in paras[:n]]


def prompts_for(workload: str, n: int) -> list[str]:
    ps = passages(n)
    if workload == "repetitive":
        return [f"{p}\n\nSay it again:\n\n{p}\n\nAnd once more:\n\n{p.split(chr(10))[0]}\n" for p in ps]
    return [p.split("\n")[0] + "\n" for p in ps]


def trimmed_draft(keep: int = 2) -> str:
    """The target cut to its first ``keep`` decoder layers (embedding, final norm and tied LM
    head kept): an untrained draft with the target's tokenizer, built once under .cache/."""
    from common import CACHE_DIR

    path = os.path.join(CACHE_DIR, f"tiny-shakespeare-trim{keep}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(path, exist_ok=True)
    for name in os.listdir(TARGET):
        if name != "model.safetensors" and os.path.isfile(os.path.join(TARGET, name)):
            shutil.copy(os.path.join(TARGET, name), path)
    weights = load_file(os.path.join(TARGET, "model.safetensors"))
    keep_prefixes = tuple(f"model.layers.{i}." for i in range(keep))
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or k.startswith(keep_prefixes)}
    save_file(kept, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(TARGET, "config.json")))
    cfg["num_hidden_layers"] = keep
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=2)
    return path


def methods(k_ngram: int, k_draft: int) -> dict:
    out = {"none": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": k_ngram, "prompt_lookup_min": 2,
                     "prompt_lookup_max": 5}}
    if os.path.isfile(os.path.join(DRAFT, "config.json")):
        out["draft_model"] = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k_draft}
    out["draft_trim2"] = {"method": "draft_model", "model": trimmed_draft(2), "num_speculative_tokens": k_draft}
    return out


class StepTimer:
    """Wraps the runner's proposer: the time spent proposing, and the whole step time."""

    def __init__(self, llm) -> None:
        self.runner = llm.engine.core.executor.worker.runner
        self.draft_s = 0.0
        spec = self.runner.spec
        self.governor = getattr(spec, "governor", None)
        if spec is not None:
            inner = spec.propose

            def timed(runner, so):
                t0 = time.perf_counter()
                try:
                    return inner(runner, so)
                finally:
                    self.draft_s += time.perf_counter() - t0

            spec.propose = timed


def run_one(llm, prompts, max_tokens: int) -> dict:
    from pagedllm import SamplingParams

    timer = StepTimer(llm)
    plain0 = timer.governor.num_plain_steps if timer.governor is not None else 0
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    s0 = llm.get_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s1 = llm.get_stats()
    steps = s1.num_steps - s0.num_steps
    drafts = s1.spec_num_drafts - s0.spec_num_drafts
    proposed = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(plain_steps=timer.governor.num_plain_steps - plain0 if timer.governor is not None else 0, wall=wall, cpu=cpu, tokens=n_tok, steps=steps, step_ms=1e3 * wall / max(steps, 1),
                draft_ms=1e3 * timer.draft_s / max(steps, 1), drafts=drafts, proposed=proposed, accepted=accepted,
                outputs=[o.outputs[0].token_ids for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "open"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k-ngram", type=int, default=4)
    ap.add_argument("--k-draft", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=None, help="subset of none, ngram, draft_model, draft_trim2")
    ap.add_argument("--no-auto-disable", action="store_true", help="speculate in every step (no governor)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1: CPU seconds per token are a load-independent figure on a shared machine)")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()

    from pagedllm import LLM

    rows, raw = [], []
    all_methods = methods(args.k_ngram, args.k_draft)
    if args.no_auto_disable:
        all_methods = {m: c and {**c, "auto_disable": False} for m, c in all_methods.items()}
    chosen = {m: c for m, c in all_methods.items() if args.methods is None or m in args.methods}
    engines = {m: LLM(model=TARGET, dtype="float32", speculative_config=c, kv_cache_memory=256 << 20, cpu_threads=args.threads,
                      max_num_seqs=max(args.batches), enable_prefix_caching=False) for m, c in chosen.items()}
    for workload in args.workloads:
        for batch in args.batches:
            prompts = prompts_for(workload, batch)
            best: dict[str, dict] = {}
            for _ in range(args.rounds):  # methods alternate inside a round: the same machine load
                for m, llm in engines.items():
                    r = run_one(llm, prompts, args.max_tokens)
                    if m not in best or r["wall"] < best[m]["wall"]:
                        best[m] = r
            base = best.get("none")
            for m, r in best.items():
                same = base is None or r["outputs"] == base["outputs"]
                tok_s = r["tokens"] / r["wall"]
                row = dict(workload=workload, batch=batch, method=m, tok_s=round(tok_s, 1),
                           cpu_ms_tok=round(1e3 * r["cpu"] / r["tokens"], 2),
                           step_ms=round(r["step_ms"], 2), draft_ms=round(r["draft_ms"], 2), identical=same)
                if r["drafts"]:
                    k = args.k_ngram if m == "ngram" else args.k_draft
                    row["plain_steps"] = r["plain_steps"]
                    a = r["accepted"] / max(r["proposed"], 1)
                    mean_len = 1 + r["accepted"] / r["drafts"]
                    model_len = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
                    row.update(acceptance=round(a, 3), mean_len=round(mean_len, 2), iid_len=round(model_len, 2),
                               drafted=round(r["drafts"] / max(r["tokens"] / (1 + r["accepted"] / r["drafts"]), 1), 2))
                if base is not None:
                    row["speedup"] = round(tok_s / (base["tokens"] / base["wall"]), 2)
                    row["cpu_speedup"] = round((base["cpu"] / base["tokens"]) / (r["cpu"] / r["tokens"]), 2)
                    if r["drafts"]:
                        # the cost model: E(a, k) tokens per step (i.i.d. acceptance at the measured
                        # rate a) at the cost t_draft + t_verify (this run's step) over t_plain
                        # (E = 1 in request-steps without drafts: no n-gram match, or the governor's plain steps)
                        e_eff = row["drafted"] * mean_len + (1 - row["drafted"])
                        row["predicted"] = round(e_eff * base["step_ms"] / r["step_ms"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)  # as it comes: a shared machine may cut the run short
                raw.append({**row, **{k: v for k, v in r.items() if k != "outputs"}})
    print_table(rows, ["workload", "batch", "method", "tok_s", "speedup", "cpu_ms_tok", "cpu_speedup", "predicted", "step_ms", "draft_ms",
                       "acceptance", "mean_len", "iid_len", "plain_steps", "identical"])
    write_json(args.out, {"args": vars(args), "rows": raw})


if __name__ == "__main__":
    main()
