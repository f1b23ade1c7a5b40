"""vLLM's metric families under --metrics-prefix vllm: names, types, label names, label values and
histogram buckets against those a live vLLM 0.32 server exported (data/vllm_metric_families.json,
written by benchmarks/vllm_metric_families.py), the values a finished request and a step add,
and the server's /metrics carrying them (real inter-token gaps included)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.core.contracts import SchedulerStats
from pagedllm.metrics.perf_model import StepCostModel
from pagedllm.outputs import CompletionOutput, RequestOutput

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_metric_families.json")
# vLLM families this engine does not export, and why (docs/usage.md's metrics section says the same)
NOT_PRODUCED: dict[str, str] = {}
# label values vLLM pre-creates that never occur here
VALUES_NOT_PRODUCED = {
    ("vllm:request_success", "finished_reason"): {"repetition"},  # no repetition detection
    ("vllm:prompt_tokens_cached_by_source", "source"): {"host", "disk", "p2p", "external_unspecified"},
    ("vllm:admission_rejections", "reason"): {"max_num_queued_tokens"},  # no queued-token limit
}
# labels: the subset of vLLM's config fields this engine has, and model_name (vLLM's info families
# lack it; here every family carries it, so several models' series stay apart)
INFO_FAMILIES = {"vllm:cache_config_info"}


def families(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        labels, values, buckets = set(), {}, set()
        for s in fam.samples:
            for k, v in s.labels.items():
                if k == "le":
                    if v != "+Inf":
                        buckets.add(float(v))
                else:
                    labels.add(k)
                    values.setdefault(k, set()).add(v)
        out[fam.name] = {"type": fam.type, "labels": sorted(labels), "values": values, "buckets": sorted(buckets),
                         "samples": {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")),
                                      s.labels.get("le")): s.value for s in fam.samples}}
    return out


# a made-up model: 100 FLOPs a token, 10 a row, 1 a pair; 1000 weight bytes, 8 KV bytes a token
STEP_COST = StepCostModel(flops_per_token=100, flops_per_row=10, flops_per_pair=1, weight_bytes=1000,
                          kv_bytes_per_token=8)


def stats(**kw):
    base = dict(num_running=1, num_waiting=3, kv_cache_usage=0.25, num_free_blocks=6, num_total_blocks=8,
                prefix_cache_queries=12, prefix_cache_hits=4, num_preemptions=1, num_scheduled_tokens_total=20,
                num_steps=3, num_batched_reqs_max=2, num_waiting_deferred=1, num_scheduled_rows_total=4,
                num_attention_pairs_total=50, num_context_tokens_total=30)
    return SchedulerStats(**{**base, **kw})


class GapsEngine:
    """What PrometheusMetrics.attach reads from an AsyncLLM."""

    def __init__(self):
        self.on_step = self.on_finished = self.on_step_phases = None
        self.stats, self.max_model_len, self.last_token_gaps = stats(), 1024, []
        self.num_queue_full, self.step_cost = 0, STEP_COST
        self.config = SimpleNamespace(enable_lora=False, kv_cache_dtype="auto", block_size=16, enable_prefix_caching=True,
                                      gpu_memory_utilization=0.9, kv_cache_memory=None, num_gpu_blocks_override=None,
                                      kv_offloading_size=None, kv_offloading_backend="native")


def fed_metrics(max_model_len: int):
    from pagedllm.metrics.prometheus import PrometheusMetrics

    pm = PrometheusMetrics("m", prefix="vllm")
    engine = GapsEngine()
    engine.max_model_len = max_model_len
    pm.attach(engine)  # cache_config_info from its config: 8 blocks of 16, prefix caching on
    engine.last_token_gaps = [0.02, 0.03, 0.5]
    engine.num_queue_full = 2  # two requests got a 429 for a full queue
    pm.on_step(stats(num_scheduled_tokens_total=27, num_steps=4, num_scheduled_rows_total=6,
                     num_attention_pairs_total=90, num_context_tokens_total=45), 0.01)
    out = RequestOutput("r", None, [1, 2, 3, 4], None, [CompletionOutput(0, "abc", [5, 6, 7, 8, 9], None, None,
                                                                         "stop")],
                        True, num_cached_tokens=2,
                        metrics={"arrival_time": 10.0, "scheduled_time": 10.5, "first_token_time": 11.0,
                                 "last_token_time": 13.0, "num_generated_tokens": 5, "max_tokens": 16,
                                 "num_preemptions": 2})
    pm.on_finished(out)
    return pm


def test_families_match_vllm_0_32():
    with open(FIXTURE) as f:
        fixture = json.load(f)
    ours = families(fed_metrics(fixture["max_model_len"]).render()[0].decode())
    theirs = fixture["families"]
    assert set(NOT_PRODUCED) <= set(theirs), "a stale NOT_PRODUCED entry"
    for name, want in theirs.items():
        if name in NOT_PRODUCED:
            assert name not in ours, f"{name} is produced now: drop it from NOT_PRODUCED"
            continue
        assert name in ours, f"vLLM exports {name}, we do not"
        got = ours[name]
        assert got["type"] == want["type"], name
        if name in INFO_FAMILIES:
            assert set(got["labels"]) - {"model_name"} <= set(want["labels"]), (name, got["labels"])
        else:
            assert got["labels"] == want["labels"], (name, got["labels"], want["labels"])
        if want["type"] == "histogram":
            assert got["buckets"] == want["buckets"], name
        for label, values in want.get("label_values", {}).items():
            if label == "engine":
                continue
            lacking = set(values) - got["values"].get(label, set()) - VALUES_NOT_PRODUCED.get((name, label), set())
            assert not lacking, (name, label, lacking)


def test_a_finished_request_and_a_step_fill_the_families():
    got = families(fed_metrics(1024).render()[0].decode())
    lbl = (("engine", "0"), ("model_name", "m"))

    def sample(family, suffix, extra=()):
        return got[family]["samples"][(family + suffix, tuple(sorted(lbl + extra)), None)]

    assert sample("vllm:request_prefill_time_seconds", "_sum") == 0.5
    assert sample("vllm:request_decode_time_seconds", "_sum") == 2.0
    assert sample("vllm:request_inference_time_seconds", "_sum") == 2.5
    assert sample("vllm:e2e_request_latency_seconds", "_sum") == 3.0
    assert sample("vllm:request_queue_time_seconds", "_sum") == 0.5
    assert sample("vllm:time_to_first_token_seconds", "_sum") == 1.0
    assert sample("vllm:request_time_per_output_token_seconds", "_sum") == 0.5
    assert sample("vllm:inter_token_latency_seconds", "_count") == 3  # the gaps themselves, not a mean
    assert abs(sample("vllm:inter_token_latency_seconds", "_sum") - 0.55) < 1e-9
    assert sample("vllm:request_params_max_tokens", "_sum") == 16
    assert sample("vllm:request_prefill_kv_computed_tokens", "_sum") == 2
    assert sample("vllm:request_num_preemptions", "_sum") == 2
    assert sample("vllm:iteration_tokens_total", "_sum") == 7
    assert sample("vllm:prompt_tokens_cached", "_total") == 2
    assert sample("vllm:prompt_tokens_by_source", "_total", (("source", "local_compute"),)) == 2
    assert sample("vllm:prompt_tokens_cached_by_source", "_total", (("source", "device"),)) == 4
    assert sample("vllm:num_requests_waiting_by_reason", "", (("reason", "capacity"),)) == 2
    assert sample("vllm:num_requests_waiting_by_reason", "", (("reason", "deferred"),)) == 1
    assert sample("vllm:request_success", "_total", (("finished_reason", "stop"),)) == 1
    assert sample("vllm:request_success", "_total", (("finished_reason", "length"),)) == 0  # made up front
    assert sample("vllm:engine_sleep_state", "", (("sleep_state", "awake"),)) == 1
    # the step model since start: 27 tokens, 6 rows, 90 attention pairs, 4 steps, 45 KV tokens read
    assert sample("vllm:estimated_flops_per_gpu", "_total") == 100 * 27 + 10 * 6 + 90
    assert sample("vllm:estimated_read_bytes_per_gpu", "_total") == 1000 * 4 + 8 * 45
    assert sample("vllm:estimated_write_bytes_per_gpu", "_total") == 8 * 27
    for family in ("external_prefix_cache_queries", "external_prefix_cache_hits", "mm_cache_queries",
                   "mm_cache_hits"):  # no KV offload tier, no multimodal processor cache
        assert sample(f"vllm:{family}", "_total") == 0
    rejected = got["vllm:admission_rejections"]["samples"]
    assert rejected[("vllm:admission_rejections_total", (("model_name", "m"), ("reason", "max_num_queued_reqs")),
                     None)] == 2
    info = got["vllm:cache_config_info"]["samples"]
    (labels,) = [dict(k) for (_, k, _) in info]
    assert labels["num_gpu_blocks"] == "8" and labels["kv_cache_size_tokens"] == "128"
    assert labels["model_name"] == "m" and labels["prefix_caching_hash_algo"] == "sha256"


def test_every_family_carries_the_model_name():
    got = families(fed_metrics(1024).render()[0].decode())
    ours = {name: fam for name, fam in got.items() if name.startswith("vllm:")}
    assert ours and all("model_name" in fam["labels"] for fam in ours.values()), \
        [name for name, fam in ours.items() if "model_name" not in fam["labels"]]


def test_server_exports_them_with_real_gaps(server, client):
    from conftest import wait_idle

    wait_idle(server.engine)
    before = families(httpx.get(server.url + "/metrics", timeout=30).text)
    client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    wait_idle(server.engine)
    got = families(httpx.get(server.url + "/metrics", timeout=30).text)

    def count(name):
        return sum(v for (s, _, le), v in got[name]["samples"].items() if s.endswith("_count")) - \
            sum(v for (s, _, le), v in before.get(name, {"samples": {}})["samples"].items() if s.endswith("_count"))

    assert count("pagedllm:request_generation_tokens") == 1 and count("pagedllm:iteration_tokens_total") >= 1
    assert count("pagedllm:inter_token_latency_seconds") == 4  # one gap per output after the first
    assert count("pagedllm:request_params_max_tokens") == 1
    assert got["pagedllm:num_requests_running"]["labels"] == ["engine", "model_name"]
    # the step model: at idle the counters hold the model's figures of the engine's counters
    cost, idle = server.engine.step_cost, server.engine.stats
    assert cost is not None and cost.flops_per_token > 0 and cost.weight_bytes > 0 and cost.kv_bytes_per_token > 0
    for name, want in zip(("flops", "read_bytes", "write_bytes"), cost.totals(idle)):
        (value,) = got[f"pagedllm:estimated_{name}_per_gpu"]["samples"].values()
        assert value == want > 0, name


def test_a_full_queue_is_counted(server):
    from conftest import wait_idle

    def rejected():
        text = httpx.get(server.url + "/metrics", timeout=30).text
        (value,) = families(text)["pagedllm:admission_rejections"]["samples"].values()
        return value

    wait_idle(server.engine)
    before = rejected()
    engine = server.engine
    engine._count("in-flight", engine.max_pending_seqs)  # as if the queue were full
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 1},
                       timeout=30)
    finally:
        engine._release("in-flight")
    assert r.status_code == 429
    assert rejected() == before + 1
