"""``pagedllm bench throughput`` and ``pagedllm bench latency``: the engine in this process.

throughput: the whole workload handed to ``LLM.generate`` at once; requests/s and tokens/s of
that call (model load and a warm-up request excluded). latency: one batch of ``--batch-size``
prompts of ``--input-len`` tokens generating ``--output-len`` tokens each (ignore_eos), timed
``--num-iters`` times after ``--num-iters-warmup`` untimed ones.

``make_llm`` (the parsed flags -> an ``LLM``) is handed in by the ``pagedllm`` CLI, which owns
the engine flags and the offline entry point.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable

from pagedllm.bench.datasets import SampleRequest, sample_requests
from pagedllm.bench.metrics import percentile


def llm_model(args) -> str:
    from pagedllm.config import default_model_path

    return args.model or default_model_path()


def _vocab_size(llm, model: str) -> int:
    """Random prompt ids are drawn below this: the tokenizer's size, else config.json's vocab_size."""
    tok = llm.get_tokenizer()
    if tok is not None:
        return len(tok)
    from pagedllm.models.config_json import load_hf_config

    return int(load_hf_config(model).vocab_size)


def _generate(llm, reqs: list[SampleRequest], n: int, temperature: float):
    from pagedllm.sampling_params import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, max_tokens=r.output_len, ignore_eos=True, seed=None)
              for r in reqs]
    if isinstance(reqs[0].prompt, str):
        return llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    return llm.generate(prompt_token_ids=[r.prompt for r in reqs], sampling_params=params, use_tqdm=False)


def run_throughput(args, make_llm: Callable[[Any], Any]) -> dict:
    llm = make_llm(args)
    try:
        tokenizer = llm.get_tokenizer()
        if args.random_vocab_size is None and tokenizer is None:
            args.random_vocab_size = _vocab_size(llm, llm_model(args))
        reqs = sample_requests(args, tokenizer)
        _generate(llm, [SampleRequest(reqs[0].prompt, reqs[0].prompt_len, 4)], 1, 0.0)  # warm-up
        t = time.perf_counter()
        outs = _generate(llm, reqs, args.n, args.temperature)
        elapsed = time.perf_counter() - t
    finally:
        llm.engine.shutdown()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"elapsed_time": elapsed, "num_requests": len(reqs), "n": args.n,
            "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "total_num_tokens": prompt_tokens + output_tokens,
            "requests_per_second": len(reqs) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed}


def throughput_report(s: dict) -> str:
    return (f"Throughput: {s['requests_per_second']:.2f} requests/s, {s['tokens_per_second']:.2f} total tokens/s, "
            f"{s['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {s['total_input_tokens']}\nTotal num output tokens:  {s['total_output_tokens']}")


LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_latency(args, make_llm: Callable[[Any], Any]) -> dict:
    for name in ("batch_size", "input_len", "num_iters"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0, got {args.num_iters_warmup}")
    output_len = 128 if args.output_len is None else args.output_len
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    llm = make_llm(args)
    try:
        vocab = args.random_vocab_size or _vocab_size(llm, llm_model(args))
        rng = random.Random(args.seed)
        batch = [SampleRequest([rng.randrange(3, vocab) for _ in range(args.input_len)], args.input_len, output_len)
                 for _ in range(args.batch_size)]
        for _ in range(args.num_iters_warmup):
            _generate(llm, batch, args.n, args.temperature)
        latencies = []
        for _ in range(args.num_iters):
            t = time.perf_counter()
            _generate(llm, batch, args.n, args.temperature)
            latencies.append(time.perf_counter() - t)
    finally:
        llm.engine.shutdown()
    s = sorted(latencies)
    return {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": output_len, "n": args.n,
            "avg_latency": sum(latencies) / len(latencies), "latencies": latencies,
            "percentiles": {str(p): percentile(s, p) for p in LATENCY_PERCENTILES}}


def latency_report(s: dict) -> str:
    lines = [f"Avg latency: {s['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in s["percentiles"].items()]
    return "\n".join(lines)
