"""The KV offload tier (issue 36) on a multi-turn chat workload whose working set is several times
the KV cache.

Workload: ``--conversations`` conversations, each opening with its own ``--doc-len``-token
document, then ``--turns`` turns; every turn after the first adds the previous answer
(``--answer-len`` generated tokens) and a new user message of ``--user-len`` tokens (a range).
Requests go out turn-major, round robin over the conversations (every conversation's turn 1,
then every turn 2, ...), at most ``--concurrency`` in flight (closed loop: the next request is
sent when one finishes), so between two turns of one conversation every other conversation runs
and its blocks push the first one's out of a small KV cache. The KV cache is sized to
1/``--working-set-ratio`` of the working set (every conversation's tokens at their last turn).

Configurations (``--configs``, run in alternating order for ``--rounds`` rounds):
  none       tier off, the small cache: each later turn recomputes its history
  host       the host-memory tier below the small cache
  disk       the disk tier alone below the small cache (files under --offload-dir)
  host+disk  host tier spilling to the disk tier (where the interface chains them)
  fits-off   tier off, a cache that holds the whole working set
  fits-host  host tier on, the same large cache: the tier must cost nothing when unused

TTFT: wall time from ``add_request`` to the engine step that returns the request's first output
token (the offline engine, in process; OUTPUT_DELTA). Throughput: (prompt + generated tokens) /
the run's wall time. Tier figures come from the engine's stats (hits, bytes in/out).

    python benchmarks/kv_offload.py                    # the issue's table (llama-100m bf16 checkpoint)
    python benchmarks/kv_offload.py --quick            # a smoke run on llama-tiny (seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, print_table, write_json  # noqa: E402

SMALL = ("none", "host", "disk", "host+disk")
CONFIGS = SMALL + ("fits-off", "fits-host")


# ---- the workload -------------------------------------------------------------------------------
def make_conversations(n: int, doc_len: int, turns: int, user_len: tuple[int, int], seed: int = 0, vocab: int = 32000):
    """Per conversation: [document + first user message, second user message, ...] as token ids."""
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        msgs = [[rng.randrange(3, vocab) for _ in range(doc_len + rng.randint(*user_len))]]
        msgs += [[rng.randrange(3, vocab) for _ in range(rng.randint(*user_len))] for _ in range(turns - 1)]
        convs.append(msgs)
    return convs


def working_set_tokens(convs, answer_len: int) -> int:
    return sum(sum(len(m) for m in msgs) + answer_len * (len(msgs) - 1) for msgs in convs)


def run_workload(llm, convs, answer_len: int, concurrency: int) -> dict:
    """Closed loop over the turn-major order; returns per-request TTFTs and totals."""
    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import OUTPUT_DELTA

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True, detokenize=False)
    order = [(c, t) for t in range(len(convs[0])) for c in range(len(convs))]
    history: list[list[int]] = [[] for _ in convs]  # prompt + answer of the last finished turn
    turn_done = [-1] * len(convs)
    inflight: dict[str, tuple[int, int, float, list[int], list[int]]] = {}  # conv, turn, sent, prompt, answer
    ttft: list[tuple[int, float]] = []  # (turn, seconds)
    prompt_tokens = out_tokens = 0
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(order) or inflight:
        # with concurrency <= conversations a turn's previous turn is always done by its turn
        while nxt < len(order) and len(inflight) < concurrency and turn_done[order[nxt][0]] == order[nxt][1] - 1:
            c, t = order[nxt]
            prompt = history[c] + convs[c][t]
            rid = eng.add_request(None, prompt, sp, output_kind=OUTPUT_DELTA)
            inflight[rid] = (c, t, time.perf_counter(), prompt, [])
            prompt_tokens += len(prompt)
            nxt += 1
        for out in eng.step():
            if out.request_id not in inflight:
                continue
            c, t, sent, prompt, answer = inflight[out.request_id]
            toks = out.outputs[0].token_ids
            if toks and not answer:
                ttft.append((t, time.perf_counter() - sent))
            answer.extend(toks)
            if out.finished:
                del inflight[out.request_id]
                history[c] = prompt + answer
                turn_done[c] = t
                out_tokens += len(answer)
    seconds = time.perf_counter() - t0
    return {"ttft": ttft, "seconds": seconds, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens}


# ---- one configuration ----------------------------------------------------------------------------
def engine_kwargs(config: str, args, small_blocks: int, large_blocks: int, offload_dir: str) -> dict:
    """LLM(...) keyword arguments of a configuration (the tier's flags as EngineConfig names them)."""
    kw = dict(model=args.model_path, dtype=args.dtype, enable_prefix_caching=True, skip_tokenizer_init=True,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              num_gpu_blocks_override=large_blocks if config.startswith("fits") else small_blocks)
    if config in ("host", "fits-host"):
        kw.update(kv_offloading_backend="native", kv_offloading_size=args.tier_gib)
    elif config == "disk":
        kw.update(kv_offloading_backend="disk", kv_offloading_size=args.tier_gib, kv_offload_dir=offload_dir)
    elif config == "host+disk":
        kw.update(kv_offloading_backend="native+disk", kv_offloading_size=args.tier_gib, kv_offload_dir=offload_dir,
                  kv_offload_host_size=args.host_gib_chained)
    return kw


def tier_figures(stats) -> dict:
    """The prefix cache's and the tier's figures from SchedulerStats."""
    out = {"prefix_hit_rate": round(stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1), 3),
           "preemptions": stats.num_preemptions}
    t = stats.kv_tier
    if t is not None:
        out.update({"tier_hit_rate": round(t.hit_tokens / max(t.lookup_tokens, 1), 3),
                    "tier_MiB_out": round(t.stored_blocks * t.bytes_per_block / 2**20, 1),
                    "tier_MiB_in": round(t.loaded_blocks * t.bytes_per_block / 2**20, 1),
                    "tier_failed_loads": t.failed_loads,
                    "tier_copy_s": round(t.transfer_seconds, 2)})
    return out


def run_config(config: str, args, convs, small_blocks: int, large_blocks: int) -> dict:
    from pagedllm import LLM, SamplingParams

    offload_dir = tempfile.mkdtemp(prefix=f"kv_offload_{config.replace('+', '_')}_", dir=args.offload_dir)
    try:
        llm = LLM(**engine_kwargs(config, args, small_blocks, large_blocks, offload_dir))
        warm = make_conversations(1, 64, 1, (16, 16), seed=999, vocab=args.vocab)[0][0]  # its own tokens: no hits for the run
        llm.generate([{"prompt_token_ids": warm}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        res = run_workload(llm, convs, args.answer_len, args.concurrency)
        stats = llm.get_stats()
        llm.shutdown()
    finally:
        shutil.rmtree(offload_dir, ignore_errors=True)
    all_t = sorted(s for _, s in res["ttft"])
    later = sorted(s for t, s in res["ttft"] if t > 0)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    row = {"config": config,
           "blocks": large_blocks if config.startswith("fits") else small_blocks,
           "ttft_p50_ms": round(statistics.median(all_t) * 1e3, 1),
           "ttft_p90_ms": round(q(all_t, 0.9) * 1e3, 1),
           "ttft_p50_later_ms": round(statistics.median(later) * 1e3, 1) if later else None,
           "seconds": round(res["seconds"], 2),
           "total_tok_s": round((res["prompt_tokens"] + res["output_tokens"]) / res["seconds"], 1)}
    row.update(tier_figures(stats))
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Median over rounds per configuration."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == config]
        merged = dict(rs[-1])
        for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p50_later_ms", "seconds", "total_tok_s"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            merged[k] = round(statistics.median(vals), 1) if vals else None
        merged["rounds"] = len(rs)
        out.append(merged)
    return out


def ratios(summary: list[dict]) -> dict:
    by = {r["config"]: r for r in summary}
    out = {}
    if "none" in by:
        for c in ("host", "disk", "host+disk"):
            if c in by:
                out[f"ttft_p50 none/{c}"] = round(by["none"]["ttft_p50_ms"] / by[c]["ttft_p50_ms"], 2)
                out[f"throughput {c}/none"] = round(by[c]["total_tok_s"] / by["none"]["total_tok_s"], 2)
    if "fits-off" in by and "fits-host" in by:
        out["fits: throughput host/off"] = round(by["fits-host"]["total_tok_s"] / by["fits-off"]["total_tok_s"], 3)
        out["fits: ttft_p50 host/off"] = round(by["fits-host"]["ttft_p50_ms"] / by["fits-off"]["ttft_p50_ms"], 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-100m", help="llama-tiny | llama-100m | a checkpoint path")
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: float32 on CPUs without native bf16)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", default="200-256", help="tokens of each user message: a range lo-hi")
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (closed loop)")
    ap.add_argument("--working-set-ratio", type=float, default=4.0, help="working set / KV cache (small configs)")
    ap.add_argument("--configs", default="none,host,disk,fits-off,fits-host")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; the order of the configs alternates")
    ap.add_argument("--tier-gib", type=float, default=4.0, help="host / disk tier size (GiB)")
    ap.add_argument("--host-gib-chained", type=float, default=0.25, help="host tier size in host+disk (GiB)")
    ap.add_argument("--offload-dir", default=None, help="where the disk tier's directory is made (default: tmp)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="llama-tiny, 4 short conversations: a smoke test")
    ap.add_argument("--out", default="benchmarks/results/kv_offload.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.conversations, args.doc_len, args.turns, args.user_len, args.answer_len = (
            "llama-tiny", 4, 256, 3, "32-48", 8)
    configs = [c for c in args.configs.split(",") if c]
    bad = sorted(set(configs) - set(CONFIGS))
    if bad:
        raise SystemExit(f"unknown configs {bad}; known: {list(CONFIGS)}")
    lo, _, hi = args.user_len.partition("-")
    user_len = (int(lo), int(hi or lo))
    args.model_path = ensure_model(args.model) if not os.path.isdir(args.model) else args.model
    with open(os.path.join(args.model_path, "config.json")) as f:
        args.vocab = json.load(f)["vocab_size"]
    convs = make_conversations(args.conversations, args.doc_len, args.turns, user_len, args.seed, args.vocab)
    ws = working_set_tokens(convs, args.answer_len)
    longest = max(sum(len(m) for m in msgs) + args.answer_len * len(msgs) for msgs in convs)
    block = 16
    small_blocks = -(-int(ws / args.working_set_ratio) // block)
    large_blocks = -(-int(ws * 1.25) // block)
    args.max_model_len = -(-longest // block) * block + block
    need = args.concurrency * -(-args.max_model_len // block)
    if small_blocks < need:
        print(f"note: {small_blocks} blocks cannot hold {args.concurrency} conversations at full length; using {need}")
        small_blocks = need
    load_before = open("/proc/loadavg").read().split()[:3]
    rows = []
    for r in range(args.rounds):
        for config in (configs if r % 2 == 0 else configs[::-1]):
            row = run_config(config, args, convs, small_blocks, large_blocks)
            row["round"] = r
            rows.append(row)
            print(row, flush=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    summary = summarize(rows)
    print(f"\nmodel={args.model} dtype={args.dtype} conversations={args.conversations} doc={args.doc_len} "
          f"turns={args.turns} user={args.user_len} answer={args.answer_len} concurrency={args.concurrency}")
    print(f"working set {ws} tokens; small cache {small_blocks} blocks ({small_blocks * block} tokens, "
          f"{ws / (small_blocks * block):.1f}x smaller); large cache {large_blocks} blocks; "
          f"load average {' '.join(load_before)} -> {' '.join(load_after)}")
    cols = ["config", "blocks", "ttft_p50_ms", "ttft_p90_ms", "ttft_p50_later_ms", "total_tok_s", "seconds",
            "prefix_hit_rate", "preemptions"]
    extra = ["tier_hit_rate", "tier_MiB_out", "tier_MiB_in", "tier_failed_loads", "tier_copy_s"]
    print_table(summary, cols + extra)
    rat = ratios(summary)
    for k, v in rat.items():
        print(f"{k}: {v}")
    result = {"argv": sys.argv if argv is None else argv, "args": vars(args), "working_set_tokens": ws,
              "small_blocks": small_blocks, "large_blocks": large_blocks, "rows": rows, "summary": summary,
              "ratios": rat, "loadavg_before": load_before, "loadavg_after": load_after}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
