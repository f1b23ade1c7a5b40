"""Prometheus metrics (prometheus.py) and the parts it makes when needed: vLLM's per-request
families, speculative decoding's counters, the KV offload tier's."""
from __future__ import annotations


def counter_delta(stats, last, name: str):
    """How far the counter field ``name`` moved from snapshot ``last`` to ``stats`` (``last``
    None: since start); never negative."""
    return max(0, getattr(stats, name) - (getattr(last, name) if last is not None else 0))
