"""Speculative decoding counters in /metrics (vLLM's spec_decode names) and the log line."""
import dataclasses

from pagedllm.core.contracts import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusMetrics, format_log_line


def stats(**kw):
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_free_blocks=9, num_total_blocks=10,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_scheduled_tokens_total=10,
                num_steps=2, num_batched_reqs_max=1)
    return SchedulerStats(**base, **kw)


def sample(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_counters_follow_the_stats():
    m = PrometheusMetrics("m")
    m.update_stats(stats())
    assert b"spec_decode" not in m.render()[0]  # no drafts yet: no series
    s1 = stats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=6, spec_accepted_per_pos=(3, 2, 1))
    m.update_stats(s1)
    s2 = dataclasses.replace(s1, spec_num_drafts=6, spec_num_draft_tokens=18, spec_num_accepted_tokens=10,
                             spec_accepted_per_pos=(5, 3, 2))
    m.update_stats(s2)
    text = m.render()[0].decode()
    assert sample(text, "pagedllm:spec_decode_num_drafts_total") == 6
    assert sample(text, "pagedllm:spec_decode_num_draft_tokens_total") == 18
    assert sample(text, "pagedllm:spec_decode_num_accepted_tokens_total") == 10
    assert sample(text, "pagedllm:spec_decode_num_emitted_tokens_total") == 16
    assert sample(text, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') == 5
    assert sample(text, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="2"') == 2
    assert abs(sample(text, "pagedllm:spec_decode_draft_acceptance_rate") - 10 / 18) < 1e-9
    line = format_log_line(s2)
    assert "acceptance 55.6%" in line and "mean accepted length 2.67" in line and "[0.83, 0.50, 0.33]" in line
    assert "spec decode" not in format_log_line(stats())
