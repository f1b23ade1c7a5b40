"""What structured outputs cost per engine step: the decode step time of a batch with 0%, 50% and
100% of its rows constrained by a JSON schema (xgrammar bitmask filled for the constrained rows
in one batched call, applied to the logits before sampling), and the grammar compile time.

The batch is admitted and prefilled first; then D decode-only steps are timed (every row samples
in each). Rounds alternate the fractions; the best round of each counts. Every row samples at
temperature 1.0 so the free rows do the same sampling work as the constrained ones. Beside the
step time, the time spent in the grammar work inside those same steps (bitmask fill, gather,
application, matcher advance) and its share of the step (median over rounds).

``--model default`` is the embedded tiny-shakespeare (byte-level BPE, vocab 2048);
``--model llama-tiny`` is benchmarks/common.py's random llama-tiny (logits 32000 wide) with the
default model's tokenizer beside it (a linked copy): ids the tokenizer lacks are masked too (the vocabulary vs
logits width case).

    python benchmarks/structured_output.py --model llama-tiny --batch 32
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "models", "tiny-shakespeare")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Long, bounded instances: 40 short strings, so a row stays constrained for every timed step.
SCHEMA = {"type": "object", "properties": {"lines": {"type": "array", "minItems": 40, "maxItems": 40,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["lines"], "additionalProperties": False}


def model_path(name: str) -> str:
    if name == "default":
        return DEFAULT_MODEL
    src = ensure_model(name) if not os.path.isdir(name) else name
    path = src.rstrip("/") + "+tokenizer"  # links to the weights, with the default model's tokenizer
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(src):
        if not os.path.exists(os.path.join(path, f)):
            os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(path, f))
    for f in TOKENIZER_FILES:
        if not os.path.exists(os.path.join(path, f)):
            shutil.copy(os.path.join(DEFAULT_MODEL, f), os.path.join(path, f))
    return path


class GrammarClock:
    """Wall time spent in the grammar work of a step (bitmask fill, its gather and application in
    the runner, matcher advance), measured inside the same steps as the step time: a share that
    holds on a machine too busy for two separate step-time runs to compare."""

    def __init__(self, engine) -> None:
        import pagedllm.sample.sampler as sampler
        import pagedllm.worker.model_runner as model_runner

        self.seconds = 0.0
        manager = engine.core.structured.manager
        manager.step_grammar = self._timed(manager.step_grammar)
        manager.advance = self._timed(manager.advance)
        sampler.apply_token_bitmask = self._timed(sampler.apply_token_bitmask)
        runner_cls = model_runner.ModelRunner
        runner_cls._attach_grammar = self._timed_method(runner_cls._attach_grammar)

    def _timed(self, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        return wrapper

    def _timed_method(self, fn):
        clock = self

        def wrapper(self_, *a, **kw):
            t = time.perf_counter()
            try:
                return fn(self_, *a, **kw)
            finally:
                clock.seconds += time.perf_counter() - t
        return wrapper


def compile_times(engine, n: int) -> list[float]:
    """Seconds to compile n distinct schemas (cache misses), after the backend is built."""
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    rng = random.Random(0)
    out = []
    for i in range(n):
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": rng.choice(["string", "integer", "boolean"])}
                                                   for j in range(rng.randint(2, 6))},
                  "required": [f"k{i}_0"]}
        t = time.perf_counter()
        engine.check_structured_outputs(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=model_path(args.model), dtype=args.dtype, enable_prefix_caching=False, kv_cache_memory=1 << 30,
              max_num_seqs=args.batch, generation_config="vllm")
    engine = llm.engine
    t = time.perf_counter()
    constrained = SamplingParams(max_tokens=2 + args.decode_tokens, temperature=1.0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine.check_structured_outputs(constrained)
    first_compile = time.perf_counter() - t  # xgrammar import + tokenizer info + one schema
    free = SamplingParams(max_tokens=2 + args.decode_tokens, temperature=1.0, ignore_eos=True)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2048) for _ in range(args.prompt_len)]} for _ in range(args.batch)]

    clock = GrammarClock(engine)

    def step_time(fraction: float) -> tuple[float, float]:
        k = round(fraction * args.batch)
        for i, p in enumerate(prompts):
            engine.add_request(engine.new_request_id(), p, constrained if i < k else free)
        while engine.core.structured.compiling or engine.get_stats().num_waiting:
            engine.step()
        while engine.num_forward_tokens < prefill_tokens[0]:
            engine.step()
        engine.step()  # the first all-decode step
        g0, t = clock.seconds, time.perf_counter()
        for _ in range(args.decode_tokens):
            engine.step()
        dt = (time.perf_counter() - t) / args.decode_tokens
        grammar = (clock.seconds - g0) / args.decode_tokens
        while engine.has_unfinished_requests():
            engine.step()
        return dt, grammar

    prefill_tokens = [engine.num_forward_tokens + args.batch * args.prompt_len]
    step_time(1.0)  # warm-up
    best = {f: (float("inf"), 0.0) for f in args.fractions}
    shares: dict[float, list[float]] = {f: [] for f in args.fractions}
    for _ in range(args.rounds):
        for f in args.fractions:
            prefill_tokens[0] = engine.num_forward_tokens + args.batch * args.prompt_len
            dt, g = step_time(f)
            shares[f].append(g / dt)
            if dt < best[f][0]:
                best[f] = (dt, g)
    base = best.get(0.0, (min(b[0] for b in best.values()),))[0]
    rows = [{"constrained": f"{f:.0%}", "step_ms": round(s * 1e3, 2), "vs_free": round(s / base, 3),
             "grammar_ms": round(g * 1e3, 3), "grammar_share": f"{sorted(shares[f])[len(shares[f]) // 2]:.1%}"}
            for f, (s, g) in best.items()]
    compiles = compile_times(engine, 10)
    llm.engine.shutdown()
    print(f"\nmodel={args.model} dtype={args.dtype} batch={args.batch} prompt_len={args.prompt_len} "
          f"decode_tokens={args.decode_tokens} logits width={engine.hf_config.vocab_size}")
    print_table(rows, ["constrained", "step_ms", "vs_free", "grammar_ms", "grammar_share"])
    print(f"first constraint (xgrammar import, tokenizer info, compile): {first_compile * 1e3:.0f} ms; "
          f"10 new schemas: median {sorted(compiles)[5] * 1e3:.1f} ms, max {max(compiles) * 1e3:.1f} ms")
    write_json(args.out, {"args": vars(args), "results": rows, "first_compile_s": first_compile,
                          "compile_s": compiles, "argv": sys.argv})


if __name__ == "__main__":
    main()
