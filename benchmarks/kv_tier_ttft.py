"""KV offload tier, the quick relative figure (issue 36; the full multi-turn chat workload is
benchmarks/kv_offload.py): ``--docs`` documents of ``--doc-len`` tokens, a device KV cache that
holds about ``--cache-docs`` of them, each document asked once (so the others evict it), then
re-asked with a new question: TTFT of the re-asks with the host tier vs without, alternated
``--rounds`` times in one sitting (one engine per variant, built once).

    python benchmarks/kv_tier_ttft.py --model llama-100m --doc-len 2048 --docs 4 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, write_json  # noqa: E402


def documents(n, length, seed=0, vocab=32000):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def ttft(eng, prompt, sp) -> float:
    """Seconds from submit to the first generated token; the request then runs to its end."""
    from pagedllm.engine.llm_engine import OUTPUT_CUMULATIVE

    t = time.perf_counter()
    rid = eng.add_request(None, prompt, sp, output_kind=OUTPUT_CUMULATIVE)
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.request_id == rid and out.outputs[0].token_ids:
                first = time.perf_counter() - t
    return first


def one_round(llm, docs, sp, round_no):
    eng = llm.engine
    for d in docs:  # turn 1: each document once; the next ones evict it from the device cache
        ttft(eng, d + [11, 12, 13, round_no], sp)
    return [ttft(eng, d + [11, 12, 13, round_no, 21, 22, 23], sp) for d in docs]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--cache-docs", type=float, default=1.5, help="device KV cache size, in documents")
    ap.add_argument("--tier-gib", type=float, default=2.0, help="host tier size (GiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams

    path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    block = 16
    blocks = int(args.cache_docs * (args.doc_len + 32) / block) + 2
    common = dict(model=path, dtype=args.dtype, skip_tokenizer_init=True, num_gpu_blocks_override=blocks,
                  max_num_seqs=4, max_model_len=min(blocks * block, args.doc_len + 64))
    variants = {"no tier": LLM(**common), "host tier": LLM(**common, kv_offloading_size=args.tier_gib)}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    docs = documents(args.docs, args.doc_len)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, llm in variants.items():  # alternated: both see the same load
            times[name] += one_round(llm, docs, sp, r)
    rows = []
    for name, llm in variants.items():
        t = times[name]
        tier = llm.get_stats().kv_tier
        rows.append({"variant": name, "re-ask TTFT p50 ms": f"{1e3 * statistics.median(t):.1f}",
                     "mean ms": f"{1e3 * statistics.mean(t):.1f}", "n": len(t),
                     "tier hit tokens": tier.hit_tokens if tier else "-",
                     "tier copy s": f"{tier.transfer_seconds:.3f}" if tier else "-"})
    base = statistics.median(times["no tier"])
    rows[1]["speed-up"] = f"{base / statistics.median(times['host tier']):.2f}x"
    print_table(rows, ["variant", "re-ask TTFT p50 ms", "mean ms", "n", "tier hit tokens", "tier copy s", "speed-up"])
    write_json(args.json, {"args": vars(args), "ttft_s": times, "rows": rows})


if __name__ == "__main__":
    main()
