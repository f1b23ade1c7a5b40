"""Prometheus exporter for the server: one CollectorRegistry per app (tests build several).

Fed by AsyncLLM's callbacks, which run on the engine thread: ``on_step(stats, seconds)`` after
every step (gauges, and counters advanced by the difference to the previous SchedulerStats
snapshot, and the inter-token gaps the output processor measured since the last step) and
``on_finished(RequestOutput)`` once per finished request (token counters and latency histograms).
prometheus_client's metrics are thread-safe.

The vLLM families carry vLLM's labels (``model_name``, ``engine``), types and buckets, checked
against a live vLLM 0.32 (tests/entrypoints/test_vllm_metrics.py); ours alone (engine_steps,
engine_step_seconds, engine_step_phase_seconds, engine_dead, kv_cache_capacity_tokens) keep
``model_name`` only.
"""
from __future__ import annotations

from pagedllm.metrics import counter_delta

import threading
import time
from typing import Optional

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)
_FINISH_REASONS = ("stop", "length", "abort", "error")
_PHASES = ("schedule", "execute", "update", "output")
_PHASE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5)
# vLLM's label sets: every engine family is labelled by model and engine index (one engine per
# server here: "0"; behind the data-parallel router each replica's series also get ``replica``).
ENGINE_LABELS = ("model_name", "engine")
_PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# cache_config_info: the labels vLLM's CacheConfig has that this engine can fill, and model_name
_CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "gpu_memory_utilization",
                      "is_attention_free", "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_offloading_backend",
                      "kv_offloading_size", "model_name", "num_gpu_blocks", "num_gpu_blocks_override",
                      "prefix_caching_hash_algo")
# admission_rejections' reasons: the in-flight limit (max_num_seqs + max_waiting_requests
# sequences) is the queue's request limit; there is no queued-token limit
_ADMISSION_REASONS = ("max_num_queued_reqs",)
_SLEEP_STATES = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}  # no sleep mode: always awake


class PrometheusMetrics:
    def __init__(self, model_name: str, registry=None, prefix: str = "pagedllm", max_model_len: int = 2048) -> None:
        """Metric names are ``PREFIX:name`` with vLLM's names, types, labels and buckets:
        ``prefix="vllm"`` makes a vLLM dashboard work unchanged. The per-request histograms
        (request_families.py) are made by ``attach`` (their token buckets go up to the engine's
        max_model_len) or on the first finished request (``max_model_len``)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        if registry is None:  # prometheus_client's process_* / python_* families too, as vLLM's default registry
            from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        r, lbl, vals = self.registry, list(ENGINE_LABELS), (model_name, "0")
        self._engine_values = vals

        def gauge(name, doc):
            return Gauge(name, doc, lbl, registry=r).labels(*vals)

        def counter(name, doc):
            return Counter(name, doc, lbl, registry=r).labels(*vals)

        def by(metric_cls, name, doc, label, values, **kw):
            m = metric_cls(name, doc, lbl + [label], registry=r, **kw)
            return m, {v: m.labels(*vals, v) for v in values}

        self.families = None  # RequestFamilies, vLLM's per-request histograms
        self._max_model_len = max_model_len
        self.num_running = gauge(f"{prefix}:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge(f"{prefix}:num_requests_waiting", "Requests waiting to be scheduled.")
        _, self._waiting_by = by(Gauge, f"{prefix}:num_requests_waiting_by_reason", "Waiting requests by reason: "
                                 "'capacity' = waiting for room in the batch or the KV cache; 'deferred' = set aside "
                                 "(LoRA slots, a batch in flight, a grammar still compiling, blocks loading from "
                                 "the KV offload tier). Sums to num_requests_waiting.", "reason", ("capacity", "deferred"))
        _, sleep = by(Gauge, f"{prefix}:engine_sleep_state", "Engine sleep state (this engine has no sleep mode: "
                      "awake is always 1).", "sleep_state", tuple(_SLEEP_STATES))
        for state, value in _SLEEP_STATES.items():
            sleep[state].set(value)
        self.kv_usage = gauge(f"{prefix}:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prefix_queries = counter(f"{prefix}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(f"{prefix}:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter(f"{prefix}:num_preemptions", "Requests preempted for lack of KV cache blocks.")
        self.prompt_tokens = counter(f"{prefix}:prompt_tokens", "Prompt tokens of finished requests.")
        _, self._prompt_by_source = by(Counter, f"{prefix}:prompt_tokens_by_source", "Prompt tokens of finished "
                                       "requests by source: computed here, found in the prefix cache, or moved in "
                                       "by a KV transfer (none here).", "source", _PROMPT_SOURCES)
        self.cached_tokens = counter(f"{prefix}:prompt_tokens_cached", "Prompt tokens of finished requests served "
                                     "from the prefix cache.")
        _, self._cached_by_source = by(Counter, f"{prefix}:prompt_tokens_cached_by_source", "Prefix-cache hit "
                                       "tokens by the cache tier that supplied them (device: the KV cache "
                                       "itself).", "source", ("device",))
        self.generation_tokens = counter(f"{prefix}:generation_tokens", "Tokens generated by finished requests.")
        self.external_queries = counter(f"{prefix}:external_prefix_cache_queries", "Prompt tokens looked up in the "
                                        "KV offload tier past the device prefix-cache hit (0 without a tier).")
        self.external_hits = counter(f"{prefix}:external_prefix_cache_hits", "Prompt tokens loaded from the KV "
                                     "offload tier (0 without a tier).")
        # no multimodal processor cache here (images are processed per request): never queried
        counter(f"{prefix}:mm_cache_queries", "Multimodal processor cache queries, in items (no such cache here: 0).")
        counter(f"{prefix}:mm_cache_hits", "Multimodal processor cache hits, in items (no such cache here: 0).")
        # the step performance model (metrics/perf_model.py), per rank
        self.est_flops = counter(f"{prefix}:estimated_flops_per_gpu", "Estimated floating-point operations per "
                                 "rank (matmuls of the tokens computed, LM head, attention).")
        self.est_read = counter(f"{prefix}:estimated_read_bytes_per_gpu", "Estimated bytes read per rank (weights "
                                "once per step, the KV cache each step's rows attend).")
        self.est_written = counter(f"{prefix}:estimated_write_bytes_per_gpu", "Estimated bytes written per rank "
                                   "(the KV cache of the tokens computed).")
        rejections = Counter(f"{prefix}:admission_rejections", "Requests refused because the queue was full (HTTP "
                             "429): max_num_queued_reqs is the limit of max_num_seqs + max_waiting_requests "
                             "sequences in flight.", ["model_name", "reason"], registry=r)
        self._rejections = {reason: rejections.labels(model_name, reason) for reason in _ADMISSION_REASONS}
        self.success, self._success = by(Counter, f"{prefix}:request_success", "Finished output sequences (n per "
                                         "request), by reason.", "finished_reason", _FINISH_REASONS)
        self._model_name = model_name
        # ours, not vLLM's: the engine loop's steps and their time
        self.steps = Counter(f"{prefix}:engine_steps", "Engine steps run.", ["model_name"],
                             registry=r).labels(model_name)
        self.step_time = Histogram(f"{prefix}:engine_step_seconds", "Duration of one engine step.", ["model_name"],
                                   buckets=_STEP_BUCKETS, registry=r).labels(model_name)
        # issue 31: where a step's time goes (engine/core.py's StepTiming, plus the front end's
        # output processing), one series per phase
        self.step_phase = Histogram(f"{prefix}:engine_step_phase_seconds", "Time of one engine step spent in each "
                                    "phase: schedule, execute (prepare inputs + forward + sample), update, "
                                    "output (detokenize, stop strings, results).", ["model_name", "phase"],
                                    buckets=_PHASE_BUCKETS, registry=r)
        self._phases = {p: self.step_phase.labels(model_name, p) for p in _PHASES}
        self.engine_dead = Gauge(f"{prefix}:engine_dead", "1 once the engine has stopped after a failure (every "
                                 "request then fails; the other figures are frozen).", ["model_name"],
                                 registry=r).labels(model_name)
        self._lock = threading.Lock()
        self._last = None  # previous SchedulerStats, for counter deltas
        self._spec = None  # speculative decoding counters (metrics/spec_decode.py), made when drafts first run
        self._kv_offload = None  # KV offload tier metrics, made when the engine has a tier
        self._prefix = prefix
        self._lora_info = None  # vLLM's lora_requests_info, when the engine serves LoRA adapters
        self._lora_labels = None
        # the attached AsyncLLM: on_step reads its last_token_gaps (inter-token latencies),
        # update_stats its queue-full refusals
        self._engine = None
        self._num_queue_full = 0  # the refusals counted so far
        self._step_cost = None  # the engine's StepCostModel (estimated_*_per_gpu), once attached
        self._kv_capacity = self._kv_info = None  # kv_cache_capacity_tokens, cache_config_info (set_kv_cache_info)

    def _request_families(self):
        if self.families is None:
            from pagedllm.metrics.request_families import RequestFamilies

            self.families = RequestFamilies(self.registry, self._prefix, ENGINE_LABELS, self._engine_values,
                                            self._max_model_len)
        return self.families

    # ---- feeding ----------------------------------------------------------------------------
    def attach(self, engine) -> None:
        """Install the callbacks on an AsyncLLM (after any already there: several apps may share
        one engine) and take its current snapshot."""
        from pagedllm.metrics.engine_callbacks import chain_engine_callbacks

        if self.families is None:
            self._max_model_len = engine.max_model_len
        families = self._request_families()  # before the callbacks can run on the engine thread
        families.on_step(engine.stats)  # the step-token baseline (iteration_tokens_total)
        self._engine = engine
        self._step_cost = engine.step_cost
        chain_engine_callbacks(engine, self.on_step, self.on_finished)
        prev_phases = engine.on_step_phases  # per-phase step timings

        def on_step_phases(timing, output_seconds: float) -> None:
            self.on_step_phases(timing, output_seconds)
            prev_phases(timing, output_seconds)

        engine.on_step_phases = on_step_phases if prev_phases is not None else self.on_step_phases
        config = engine.config
        if config.enable_lora and self._lora_info is None:
            from prometheus_client import Gauge

            self._lora_info = Gauge(f"{self._prefix}:lora_requests_info", "Running stats on LoRA requests: the "
                                    "adapters of running and waiting requests (comma-separated); the value is the "
                                    "time of the last change.", ["model_name", "max_lora", "waiting_lora_adapters",
                                                                 "running_lora_adapters"], registry=self.registry)
            self._max_lora = str(config.max_loras)
        self.set_kv_cache_info(config, engine.stats.num_total_blocks)
        self.update_stats(engine.stats)

    def set_kv_cache_info(self, config, num_blocks: int) -> None:
        """``kv_cache_capacity_tokens`` (blocks x block size) and ``cache_config_info`` (value 1; the
        EngineConfig's KV cache settings as labels, under vLLM's CacheConfig field names)."""
        from prometheus_client import Gauge

        if self._kv_capacity is None:
            self._kv_capacity = Gauge(f"{self._prefix}:kv_cache_capacity_tokens", "Tokens the KV cache holds "
                                      "(blocks x block size; 8-bit kv_cache_dtype holds ~2x).", ["model_name"],
                                      registry=self.registry).labels(self._model_name)
            self._kv_info = Gauge(f"{self._prefix}:cache_config_info", "Information of the KV cache configuration "
                                  "(value 1).", list(_CACHE_INFO_LABELS), registry=self.registry)
        tokens = num_blocks * config.block_size
        self._kv_capacity.set(tokens)
        self._kv_info.clear()
        self._kv_info.labels(
            block_size=str(config.block_size), cache_dtype=config.kv_cache_dtype,
            enable_prefix_caching=str(config.enable_prefix_caching), engine="0",
            gpu_memory_utilization=str(config.gpu_memory_utilization), is_attention_free="False",
            kv_cache_memory_bytes=str(config.kv_cache_memory), kv_cache_size_tokens=str(tokens),
            kv_offloading_backend=config.kv_offloading_backend, kv_offloading_size=str(config.kv_offloading_size),
            model_name=self._model_name, num_gpu_blocks=str(num_blocks),
            num_gpu_blocks_override=str(config.num_gpu_blocks_override),
            prefix_caching_hash_algo="sha256").set(1)

    def update_stats(self, stats) -> None:
        if stats is None:
            return
        with self._lock:
            self.num_running.set(stats.num_running)
            self.num_waiting.set(stats.num_waiting)
            deferred = min(stats.num_waiting, stats.num_waiting_deferred)
            self._waiting_by["capacity"].set(stats.num_waiting - deferred)
            self._waiting_by["deferred"].set(deferred)
            self.kv_usage.set(stats.kv_cache_usage)
            if self._lora_info is not None:
                labels = (self._model_name, self._max_lora, ",".join(stats.waiting_loras),
                          ",".join(stats.running_loras))
                if labels != self._lora_labels:  # one series: the current adapters
                    self._lora_info.clear()
                    self._lora_info.labels(*labels).set(time.time())
                    self._lora_labels = labels
            last = self._last

            def delta(name):
                return counter_delta(stats, last, name)

            hits = delta("prefix_cache_hits")
            self.prefix_queries.inc(delta("prefix_cache_queries"))
            self.prefix_hits.inc(hits)
            self._cached_by_source["device"].inc(hits)
            self.preemptions.inc(delta("num_preemptions"))
            self.steps.inc(delta("num_steps"))
            if self._engine is not None:
                refused = self._engine.num_queue_full
                self._rejections["max_num_queued_reqs"].inc(max(0, refused - self._num_queue_full))
                self._num_queue_full = refused
            if self._step_cost is not None:
                now = self._step_cost.totals(stats)
                before = self._step_cost.totals(last) if last is not None else (0, 0, 0)
                for counter, a, b in zip((self.est_flops, self.est_read, self.est_written), now, before):
                    counter.inc(max(0, a - b))
            if self._spec is None and stats.spec_num_drafts:
                from pagedllm.metrics.spec_decode import SpecDecodeMetrics

                self._spec = SpecDecodeMetrics(self.registry, self._prefix, ENGINE_LABELS, self._engine_values)
            if self._spec is not None:
                self._spec.update(stats, last)
            if stats.kv_tier is not None:  # the KV offload tier (metrics/kv_offload.py)
                if self._kv_offload is None:
                    from pagedllm.metrics.kv_offload import KVOffloadMetrics

                    self._kv_offload = KVOffloadMetrics(self.registry, self._prefix, self._model_name)
                tier, last_tier = stats.kv_tier, last.kv_tier if last is not None else None
                self.external_queries.inc(counter_delta(tier, last_tier, "lookup_tokens"))
                self.external_hits.inc(counter_delta(tier, last_tier, "hit_tokens"))
                self._kv_offload.update(tier, last_tier)
            self._last = stats

    def on_step(self, stats, seconds: float) -> None:
        self.update_stats(stats)
        self.step_time.observe(seconds)
        families = self._request_families()
        families.on_step(stats)
        if self._engine is not None:
            families.on_token_gaps(self._engine.last_token_gaps)

    def on_step_phases(self, timing, output_seconds: float) -> None:
        """One core step's StepTiming and the front end's output processing of it."""
        ph = self._phases
        ph["schedule"].observe(timing.schedule)
        ph["execute"].observe(timing.execute)
        ph["update"].observe(timing.update)
        ph["output"].observe(output_seconds)

    def on_finished(self, out) -> None:
        m = out.metrics or {}
        num_prompt = len(out.prompt_token_ids or ())
        cached = min(num_prompt, max(0, out.num_cached_tokens or 0))
        self.prompt_tokens.inc(num_prompt)
        self._prompt_by_source["local_compute"].inc(num_prompt - cached)
        self._prompt_by_source["local_cache_hit"].inc(cached)
        self.cached_tokens.inc(cached)
        n_gen = m.get("num_generated_tokens")
        if n_gen is None:
            n_gen = sum(len(o.token_ids) for o in out.outputs)
        self.generation_tokens.inc(n_gen)
        self._request_families().on_finished(out, n_gen)
        for o in out.outputs:
            reason = o.finish_reason or "abort"
            counter = self._success.get(reason)
            if counter is None:
                counter = self._success[reason] = self.success.labels(*self._engine_values, reason)
            counter.inc()

    # ---- export -----------------------------------------------------------------------------
    def render(self, stats=None, engine_dead: bool = False) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.update_stats(stats)
        self.engine_dead.set(1 if engine_dead else 0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def format_log_line(stats, tokens_per_s: Optional[float] = None) -> str:
    """One human-readable status line (the server logs it periodically while busy)."""
    parts = [] if tokens_per_s is None else [f"throughput: {tokens_per_s:.1f} tokens/s"]
    parts += [
        f"running: {stats.num_running} reqs",
        f"waiting: {stats.num_waiting} reqs",
        f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%",
        f"prefix cache hit rate: {100 * stats.prefix_cache_hits / max(1, stats.prefix_cache_queries):.1f}%",
        f"preemptions: {stats.num_preemptions}",
    ]
    from pagedllm.metrics.spec_decode import spec_decode_summary

    spec = spec_decode_summary(stats)
    if spec:
        parts.append(spec)
    tier = stats.kv_tier
    if tier is not None:
        parts.append(f"KV offload tier usage: {100 * tier.usage:.1f}%, hit rate: "
                     f"{100 * tier.hit_tokens / max(1, tier.lookup_tokens):.1f}%")
    return ", ".join(parts)
