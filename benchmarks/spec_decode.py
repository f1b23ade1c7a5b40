"""Speculative decoding on CPU: decode tok/s with n-gram lookup and a draft model against no
speculation, with the acceptance figures and a cost model that predicts the speed-up.

Target: the embedded default model (models/tiny-shakespeare); draft: the same recipe, smaller
(``python scripts/train_default_model.py --preset draft`` -> models/tiny-shakespeare-draft),
same tokenizer; eagle: the EAGLE-1 head models/tiny-shakespeare-eagle (scripts/train_eagle_head.py),
``--k-draft`` drafts. Workloads (greedy, ignore_eos, fixed max_tokens):
  repetitive  -- a passage from the validation text, then the instruction to repeat it and its
                 first line again (this small model does not copy it: what n-gram lookup finds are
                 the loops it falls into, and the passage's names and phrases);
  open        -- the first lines of validation passages, continued freely.
Batch 1 is latency: ``--latency-prompts`` prompts, each alone; larger batches run all at once.

Methods: none, ngram (k = ``--k-ngram``, n = ``--ngram-min``..``--ngram-max``), draft_model
(k = ``--k-draft``), draft_trim2 (the target cut to 2 layers, untrained); each with the governor
(``auto_disable``, the default) and as ``<method>-always`` (every step speculates). For every
(workload, batch, method) the same prompts run back to back ``--rounds`` times; the best round
counts (the machine is shared).

The cost model, over decode steps (``StepTimer``: every engine step timed, schedule to update):
a plain step costs t_plain (the no-speculation run's mean) and emits 1 token per request; a
speculative one costs t_spec = t_draft (the proposer: n-gram lookup or the draft model's
forwards) + t_verify (the target's (k+1)-token forward, verification, bookkeeping) and emits E
tokens per request (measured); a fraction f of the request-steps speculated (the governor ran the
others plainly). Predicted decode speed-up = (f E + 1 - f) t_plain / (f t_spec + (1 - f) t_plain),
checked against the measured tok/s ratio (``speedup``; ``cpu_speedup`` is the same from the
process's CPU seconds, steadier on a shared machine with ``--threads 1``; prefill is in both).

    python benchmarks/spec_decode.py --batches 1 32 --threads 1 \\
        --methods none ngram ngram-always draft_model draft_model-always
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
EAGLE = os.path.join(REPO, "models", "tiny-shakespeare-eagle")  # scripts/train_eagle_head.py


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


def methods(k_ngram: int, k_draft: int, n_min: int, n_max: int) -> dict:
    out = {"none": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": k_ngram, "prompt_lookup_min": n_min,
                     "prompt_lookup_max": n_max}}
    if os.path.isfile(os.path.join(DRAFT, "config.json")):
        out["draft_model"] = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k_draft}
    out["draft_trim2"] = {"method": "draft_model", "model": trimmed_draft(2), "num_speculative_tokens": k_draft}
    if os.path.isfile(os.path.join(EAGLE, "config.json")):  # an EAGLE-1 head over the target's features
        out["eagle"] = {"method": "eagle", "model": EAGLE, "num_speculative_tokens": k_draft}
    return out


class StepTimer:
    """Times every engine step (schedule + execute + update) and the proposer's share, and keeps
    what each step was: decode-only or not, speculative (draft slots) or plain, tokens emitted."""

    def __init__(self, llm) -> None:
        core = llm.engine.core
        self.runner = core.executor.worker.runner
        self.governor = core.scheduler.spec_governor
        self.steps: list[tuple[bool, bool, float, float, int, int]] = []  # decode_only, spec, wall, draft, reqs, tokens
        self._draft = 0.0
        self._so = None
        sched, spec = core.scheduler, self.runner.spec
        inner_schedule, inner_step = sched.schedule, core.step

        def schedule(*a, **kw):
            self._so = so = inner_schedule(*a, **kw)
            return so

        def step():
            self._draft, t0 = 0.0, time.perf_counter()
            outs = inner_step()
            wall, so = time.perf_counter() - t0, self._so
            if so is not None and so.num_scheduled_tokens:
                slots = so.num_spec_slots
                decode = all(n == 1 + slots.get(r, 0) for r, n in so.num_scheduled_tokens.items())
                self.steps.append((decode, bool(slots), wall, self._draft, len(so.num_scheduled_tokens),
                                   sum(len(o.new_token_ids) for o in outs)))
            return outs

        sched.schedule, core.step = schedule, step
        if spec is not None:
            inner = spec.propose

            def timed(runner, so):
                t0 = time.perf_counter()
                try:
                    return inner(runner, so)
                finally:
                    self._draft += time.perf_counter() - t0

            spec.propose = timed

    def summary(self) -> dict:
        """Decode-only steps: mean wall time of plain and speculative ones (ms), the proposer's
        share of a speculative one, tokens per request per speculative step, the speculative
        fraction of decode request-steps."""
        def mean(xs):
            return 1e3 * sum(xs) / len(xs) if xs else None

        dec = [s for s in self.steps if s[0]]
        spec = [s for s in dec if s[1]]
        plain = [s for s in dec if not s[1]]
        reqs_spec = sum(s[4] for s in spec)
        return dict(t_plain=mean([s[2] for s in plain]), t_spec=mean([s[2] for s in spec]),
                    t_draft=mean([s[3] for s in spec]), n_spec=len(spec), n_plain=len(plain),
                    e_spec=sum(s[5] for s in spec) / reqs_spec if reqs_spec else None,
                    f_spec=reqs_spec / max(sum(s[4] for s in dec), 1))


def run_one(llm, timer: StepTimer, prompts, max_tokens: int, one_at_a_time: bool) -> dict:
    """``one_at_a_time``: each prompt alone (batch-1 latency), else all at once."""
    from pagedllm import SamplingParams

    timer.steps.clear()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    s0 = llm.get_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = [o for g in groups for o in llm.generate(g, sp, use_tqdm=False)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s1 = llm.get_stats()
    steps = s1.num_steps - s0.num_steps
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall=wall, cpu=cpu, tokens=n_tok, steps=steps, step_ms=1e3 * wall / max(steps, 1),
                drafts=s1.spec_num_drafts - s0.spec_num_drafts, proposed=s1.spec_num_draft_tokens - s0.spec_num_draft_tokens,
                accepted=s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens, **timer.summary(),
                outputs=[o.outputs[0].token_ids for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "open"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k-ngram", type=int, default=8)
    ap.add_argument("--ngram-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--ngram-max", type=int, default=5, help="prompt_lookup_max")
    ap.add_argument("--k-draft", type=int, default=2)
    ap.add_argument("--latency-prompts", type=int, default=8, help="batch 1: this many prompts, one at a time")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of none, ngram, draft_model, draft_trim2, eagle (+ '-always': the same without the governor)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1: CPU seconds per token are a load-independent figure on a shared machine)")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()

    from pagedllm import LLM

    rows, raw = [], []
    all_methods = methods(args.k_ngram, args.k_draft, args.ngram_min, args.ngram_max)
    all_methods.update({f"{m}-always": {**c, "auto_disable": False} for m, c in list(all_methods.items()) if c})
    default = [m for m in all_methods if m != "draft_trim2" and not m.endswith("-always")]
    chosen = {m: c for m, c in all_methods.items() if m in (args.methods or default)}
    engines = {m: LLM(model=TARGET, dtype="float32", speculative_config=c, kv_cache_memory=256 << 20, cpu_threads=args.threads,
                      max_num_seqs=max(args.batches), enable_prefix_caching=False) for m, c in chosen.items()}
    timers = {m: StepTimer(llm) for m, llm in engines.items()}
    for workload in args.workloads:
        for batch in args.batches:
            prompts = prompts_for(workload, args.latency_prompts if batch == 1 else batch)
            best: dict[str, dict] = {}
            for _ in range(args.rounds):  # methods alternate inside a round: the same machine load
                for m, llm in engines.items():
                    r = run_one(llm, timers[m], prompts, args.max_tokens, one_at_a_time=batch == 1)
                    if m not in best or r["wall"] < best[m]["wall"]:
                        best[m] = r
            base = best.get("none")
            for m, r in best.items():
                same = base is None or r["outputs"] == base["outputs"]
                tok_s = r["tokens"] / r["wall"]
                row = dict(workload=workload, batch=batch, method=m, tok_s=round(tok_s, 1),
                           cpu_ms_tok=round(1e3 * r["cpu"] / r["tokens"], 2), identical=same,
                           t_plain=r["t_plain"] and round(r["t_plain"], 2), plain_steps=r["n_plain"],
                           spec_steps=r["n_spec"])
                if r["drafts"] and r["e_spec"] is not None:
                    a = r["accepted"] / max(r["proposed"], 1)
                    row.update(acceptance=round(a, 3), mean_len=round(1 + r["accepted"] / r["drafts"], 2),
                               e_spec=round(r["e_spec"], 2), t_spec=round(r["t_spec"], 2),
                               t_draft=round(r["t_draft"], 2), t_verify=round(r["t_spec"] - r["t_draft"], 2))
                if base is not None:
                    row["speedup"] = round(tok_s / (base["tokens"] / base["wall"]), 2)
                    row["cpu_speedup"] = round((base["cpu"] / base["tokens"]) / (r["cpu"] / r["tokens"]), 2)
                    if r["drafts"] and r["e_spec"] is not None and base["t_plain"]:
                        # the cost model, decode steps: a speculative step emits E tokens per request in
                        # t_draft + t_verify, a plain one 1 token in t_plain (from the no-speculation run);
                        # a fraction f of the request-steps speculated (the governor ran the rest plainly)
                        f, e, tp = r["f_spec"], r["e_spec"], base["t_plain"]
                        row["predicted"] = round((f * e + 1 - f) * tp / (f * r["t_spec"] + (1 - f) * tp), 2)
                        # measured, decode steps only (the same steps the prediction covers)
                        dec_tokens_per_ms = (f * e + 1 - f) / (f * r["t_spec"] + (1 - f) * (r["t_plain"] or tp))
                        row["decode_speedup"] = round(dec_tokens_per_ms * tp, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)  # as it comes: a shared machine may cut the run short
                raw.append({**row, **{k: v for k, v in r.items() if k != "outputs"}})
    print_table(rows, ["workload", "batch", "method", "tok_s", "speedup", "cpu_ms_tok", "cpu_speedup", "predicted",
                       "decode_speedup", "t_plain", "t_spec", "t_draft", "t_verify", "acceptance", "mean_len", "e_spec",
                       "spec_steps", "plain_steps", "identical"])
    write_json(args.out, {"args": vars(args), "rows": raw})


if __name__ == "__main__":
    main()
