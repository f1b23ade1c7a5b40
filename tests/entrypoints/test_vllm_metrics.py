"""vLLM's per-request metric families (request_families.py): names, types and labels under the
prefix, the values a finished request adds, and the server's /metrics carrying them."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.outputs import CompletionOutput, RequestOutput

FAMILIES = {
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_time_per_output_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "iteration_tokens_total": "histogram", "prompt_tokens_cached": "counter",
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_finished_request_fills_the_families():
    from pagedllm.metrics.prometheus import PrometheusMetrics

    pm = PrometheusMetrics("m", prefix="vllm")
    out = RequestOutput("r", None, [1, 2, 3, 4], None, [CompletionOutput(0, "abc", [5, 6, 7, 8, 9], None, None, "stop")],
                        True, num_cached_tokens=2,
                        metrics={"arrival_time": 10.0, "scheduled_time": 10.5, "first_token_time": 11.0,
                                 "last_token_time": 13.0, "num_generated_tokens": 5})
    pm.on_finished(out)
    got = families(pm.render()[0].decode())
    for name, kind in FAMILIES.items():
        assert got[f"vllm:{name}"].type == kind, name
    samples = {(s.name, s.labels.get("le")): s.value for f in got.values() for s in f.samples}
    assert samples[("vllm:request_prefill_time_seconds_sum", None)] == 0.5
    assert samples[("vllm:request_decode_time_seconds_sum", None)] == 2.0
    assert samples[("vllm:request_inference_time_seconds_sum", None)] == 2.5
    assert samples[("vllm:request_time_per_output_token_seconds_sum", None)] == 0.5
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == 4
    assert samples[("vllm:inter_token_latency_seconds_sum", None)] == 2.0
    assert samples[("vllm:request_prompt_tokens_sum", None)] == 4
    assert samples[("vllm:prompt_tokens_cached_total", None)] == 2
    assert all(s.labels.get("model_name") == "m" for f in got.values() for s in f.samples
               if f.name.startswith("vllm:request_"))


def test_server_exports_them(server, client):
    client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=4, temperature=0)
    got = families(httpx.get(server.url + "/metrics", timeout=30).text)
    for name in FAMILIES:
        assert f"pagedllm:{name}" in got, name
    count = [s.value for s in got["pagedllm:request_generation_tokens"].samples if s.name.endswith("_count")]
    iters = [s.value for s in got["pagedllm:iteration_tokens_total"].samples if s.name.endswith("_count")]
    assert count[0] >= 1 and iters[0] >= 1
