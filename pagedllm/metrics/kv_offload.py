"""KV offload tier metrics (core/kv_tier.py's KVTierStats), named in vLLM's spirit: the tier is
vLLM's "external" prefix cache (``external_prefix_cache_queries`` / ``_hits``: tokens looked up in
the tier past the device prefix cache's hit, and found there); bytes moved each way, failed loads
(recomputed instead), the tier's usage, and the workers' copy time per step that moved blocks.
The KV usage gauge (``kv_cache_usage_perc``) stays the device cache's. The two vLLM-named families
carry vLLM's label set (model and engine index), ours the model name only, as in prometheus.py.
"""
from __future__ import annotations

from pagedllm.metrics import counter_delta

_COPY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVOffloadMetrics:
    def __init__(self, registry, prefix: str, engine_labels: tuple[str, ...], engine_values: tuple[str, ...]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        model_name = engine_values[list(engine_labels).index("model_name")]
        lbl = ["model_name"]

        def counter(name, doc, labels=lbl, values=(model_name,)):
            return Counter(f"{prefix}:{name}", doc, list(labels), registry=registry).labels(*values)

        self.queries = counter("external_prefix_cache_queries",
                               "Prompt tokens looked up in the KV offload tier (past the device prefix-cache hit).",
                               engine_labels, engine_values)
        self.hits = counter("external_prefix_cache_hits", "Prompt tokens loaded from the KV offload tier.",
                            engine_labels, engine_values)
        self.bytes_stored = counter("kv_offload_stored_bytes", "Bytes of KV blocks copied to the offload tier.")
        self.bytes_loaded = counter("kv_offload_loaded_bytes", "Bytes of KV blocks loaded back from the offload tier.")
        self.failed = counter("kv_offload_failed_loads", "Blocks whose load from the tier failed (recomputed).")
        self.usage = Gauge(f"{prefix}:kv_offload_usage_perc", "Fraction of the KV offload tier's blocks in use (0..1).",
                           lbl, registry=registry).labels(model_name)
        self.copy_time = Histogram(f"{prefix}:kv_offload_copy_seconds", "Workers' time copying blocks to and from "
                                   "the KV offload tier, per step that moved blocks.", lbl, buckets=_COPY_BUCKETS,
                                   registry=registry).labels(model_name)

    def update(self, stats, last) -> None:
        """Advance by the difference between two KVTierStats snapshots (``last`` None: since start)."""
        def delta(name):
            return counter_delta(stats, last, name)

        self.queries.inc(delta("lookup_tokens"))
        self.hits.inc(delta("hit_tokens"))
        self.bytes_stored.inc(delta("stored_blocks") * stats.bytes_per_block)
        self.bytes_loaded.inc(delta("loaded_blocks") * stats.bytes_per_block)
        self.failed.inc(delta("failed_loads"))
        self.usage.set(stats.usage)
        steps = delta("num_transfer_steps")
        if steps and last is not None:
            per_step = delta("transfer_seconds") / steps
            for _ in range(min(steps, 16)):
                self.copy_time.observe(per_step)
