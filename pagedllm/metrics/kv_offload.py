"""KV offload tier metrics (core/kv_tier.py's KVTierStats), named in vLLM's spirit: bytes moved
each way, failed loads (recomputed instead), the tier's usage, and the workers' copy time per step
that moved blocks; labelled by the model name only, as prometheus.py's own families. The tier is
vLLM's "external" prefix cache: ``external_prefix_cache_queries`` / ``_hits`` (vLLM's families,
made by prometheus.py with or without a tier) count the tokens looked up in it and found there.
The KV usage gauge (``kv_cache_usage_perc``) stays the device cache's.
"""
from __future__ import annotations

from pagedllm.metrics import counter_delta

_COPY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVOffloadMetrics:
    def __init__(self, registry, prefix: str, model_name: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        lbl = ["model_name"]

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, lbl, registry=registry).labels(model_name)

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

        self.bytes_stored.inc(delta("stored_blocks") * stats.bytes_per_block)
        self.bytes_loaded.inc(delta("loaded_blocks") * stats.bytes_per_block)
        self.failed.inc(delta("failed_loads"))
        self.usage.set(stats.usage)
        steps = delta("num_transfer_steps")
        if steps and last is not None:
            per_step = delta("transfer_seconds") / steps
            for _ in range(min(steps, 16)):
                self.copy_time.observe(per_step)
