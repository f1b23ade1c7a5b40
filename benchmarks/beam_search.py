"""Beam search inside the engine (shared KV blocks, copy-on-write) vs the same work done as W
independent sequences (n = W sampled requests: the prompt's full blocks shared through the prefix
cache, nothing else), and optionally vs HF transformers' generate(num_beams=W).

Every prompt runs to max_tokens (ignore_eos), so each mode computes W x max_tokens tokens per
prompt. Reported: wall time, tokens computed per second (W x generated, all beams), the peak
number of KV blocks in use (sampled after every step) and what W private copies would hold.

    python benchmarks/beam_search.py --model llama-tiny --prompts 8 --prompt-len 200 --max-tokens 64 --widths 4 8
    python benchmarks/beam_search.py --model llama-100m --prompts 4 --widths 4 8 --hf
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, write_json  # noqa: E402


def run(llm, prompts, params) -> tuple[float, int]:
    """(seconds, peak blocks in use) for all prompts submitted together."""
    eng, kv = llm.engine, llm.engine.core.kv_cache_manager
    t = time.perf_counter()
    for p in prompts:
        eng.add_request(None, {"prompt_token_ids": p}, params)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, kv.num_total_blocks - kv.num_free_blocks)
    return time.perf_counter() - t, peak


def hf_beam(path, prompts, width, max_tokens) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    t = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            m.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                       do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None,
                       pad_token_id=0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers' beam search (bf16)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from pagedllm.engine.beam_search import BeamSearchParams
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    llm = LLM(model=path, block_size=args.block_size, kv_cache_memory=1 << 30, max_num_seqs=256, skip_tokenizer_init=True)
    bs, n = args.block_size, args.max_tokens
    rows = []
    for w in args.widths:
        run(llm, prompts[:1], BeamSearchParams(beam_width=w, max_tokens=4, ignore_eos=True))  # warm-up
        llm.reset_prefix_cache()
        private = args.prompts * w * -(-(args.prompt_len + n) // bs)
        secs, peak = run(llm, prompts, BeamSearchParams(beam_width=w, max_tokens=n, ignore_eos=True))
        llm.reset_prefix_cache()
        rows.append(dict(mode=f"beam search W={w}", seconds=round(secs, 2), tok_s=round(args.prompts * w * n / secs),
                         peak_blocks=peak, private_blocks=private))
        secs, peak = run(llm, prompts, SamplingParams(n=w, temperature=1.0, seed=0, max_tokens=n, ignore_eos=True))
        llm.reset_prefix_cache()
        rows.append(dict(mode=f"n={w} independent", seconds=round(secs, 2), tok_s=round(args.prompts * w * n / secs),
                         peak_blocks=peak, private_blocks=private))
        if args.hf:
            secs = hf_beam(path, prompts, w, n)
            rows.append(dict(mode=f"HF generate num_beams={w}", seconds=round(secs, 2),
                             tok_s=round(args.prompts * w * n / secs), peak_blocks="-", private_blocks=private))
    print_table(rows, ["mode", "seconds", "tok_s", "peak_blocks", "private_blocks"])
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
