"""SimulatedDeviceExecutor: a device queue simulated on CPU, to test host/device overlap in CI.

``submit(scheduler_output)`` spends ``host_seconds`` on the calling thread (what preparing a
step's inputs and launching its kernels costs the host) and queues the step on a "device"
thread; it returns without waiting. The device thread runs queued steps one after another, in
order (as a GPU stream does), each taking at least ``device_seconds`` of the device's own clock; ``collect()`` returns the
oldest step's ModelRunnerOutput once it is done. ``execute`` is submit + collect (no overlap).

What a step computes: with ``inner`` (a real executor, e.g. UniprocExecutor) its forward and
sampling run on the device thread, so outputs are the model's; with ``host_only`` as well (the
runner mode) the real runner's host work -- diffs, input preparation, state update, output
assembly -- runs on the submitting thread and only the forward and sampling are the device's
``device_seconds`` (tokens made from positions): what the host pays per step in front of a GPU;
without ``inner``, a ``FakeDeviceModel``
produces tokens as a fixed function of each request's tokens so far (the same whatever the
batching, so a test can compare schedules exactly without a model).

With ``max_concurrent_batches`` = 2 the engine core keeps two micro-batches in flight through
submit/collect (engine/core.py, as for pipeline stages): it schedules and prepares one half of
the requests while the device runs the other half. ``SimulatedDevice`` builds one inside an
engine-core process (a picklable factory for MultiprocClient).
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

from pagedllm.core.contracts import KVTierSpec, ModelRunnerOutput, SchedulerOutput


class FakeDeviceModel:
    """Per-request token state, kept as a runner keeps it (from the scheduler's diffs and its
    own sampled tokens). Next token: a hash of the request's last tokens and its length."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_forward_tokens = 0

    def next_token(self, tokens: list[int]) -> int:
        h = len(tokens) * 1_000_003
        for t in tokens[-4:]:
            h = (h * 31 + t) % 2_147_483_647
        return h % self.vocab_size

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.num_spec_slots or so.block_copies or any(r.beam is not None for r in so.scheduled_new_reqs):
            raise ValueError("the fake device model runs plain requests only (no drafts, no beams)")
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.computed.pop(rid, None)
        for r in so.scheduled_new_reqs:
            self.tokens[r.req_id] = list(r.token_ids)
            self.computed[r.req_id] = r.num_computed_tokens
        for r in so.scheduled_cached_reqs:
            self.computed[r.req_id] = r.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            self.num_forward_tokens += n
            self.computed[rid] += n
            toks = self.tokens[rid]
            req_ids.append(rid)
            if self.computed[rid] >= len(toks):  # the last prompt chunk or a decode step: one token out
                t = self.next_token(toks)
                toks.append(t)
                sampled.append([t])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


class SimulatedDeviceExecutor:
    num_blocks: int
    max_model_len: int
    sliding_window: Optional[int]
    kv_tier_spec: Optional[KVTierSpec]
    max_concurrent_batches: int
    is_dead = False
    dead_reason: Optional[str] = None

    def __init__(self, num_blocks: int, max_model_len: int, device_seconds: float, host_seconds: float = 0.0,
                 inner=None, vocab_size: int = 1024, max_concurrent_batches: int = 1, host_only: bool = False) -> None:
        self.inner = inner
        self.host_only = host_only and inner is not None
        self.max_concurrent_batches = max_concurrent_batches
        self.model = inner if inner is not None else FakeDeviceModel(vocab_size)
        self.num_blocks = inner.num_blocks if inner is not None else num_blocks
        self.max_model_len = inner.max_model_len if inner is not None else max_model_len
        self.sliding_window = inner.sliding_window if inner is not None else None
        self.kv_tier_spec = inner.kv_tier_spec if inner is not None else None
        self.device_seconds = device_seconds
        self.host_seconds = host_seconds
        self.device_busy = 0.0  # seconds the device thread spent on steps
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: list[Future] = []
        self._thread = threading.Thread(target=self._device, name="simulated-device", daemon=True)
        self._thread.start()

    # ---- the device thread ------------------------------------------------------------------
    def _device(self) -> None:
        """Runs steps on the device's own clock: a step starts when it was submitted or when the
        previous one finished (``free_at``), whichever is later, not when this thread next gets
        to run (a GPU stream runs queued kernels back to back, whenever the host notices), so a
        late wake-up from the sleep or a wait for the GIL delays the host's collect, never the
        device."""
        free_at = 0.0
        while True:
            item = self._queue.get()
            if item is None:
                return
            so, fut, submitted, out = item
            start = max(submitted, free_at)
            try:
                out = self.model.execute(so) if out is None else out
            except BaseException as e:
                free_at = time.perf_counter()
                fut.set_exception(e)
                continue
            free_at = max(start + self.device_seconds, time.perf_counter())
            left = free_at - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self.device_busy += free_at - start
            fut.set_result(out)

    # ---- the executor -----------------------------------------------------------------------
    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self.host_seconds > 0:
            time.sleep(self.host_seconds)  # preparing inputs, launching kernels
        out = self.inner.execute_host(scheduler_output) if self.host_only else None  # runner mode: on this thread
        fut: Future = Future()
        self._futures.append(fut)
        self._queue.put((scheduler_output, fut, time.perf_counter(), out))

    def collect(self) -> ModelRunnerOutput:
        return self._futures.pop(0).result()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    @property
    def num_forward_tokens(self) -> int:
        return self.model.num_forward_tokens

    @property
    def weight_bytes_per_rank(self) -> list[int]:
        return self.inner.weight_bytes_per_rank if self.inner is not None else [0]

    def idle_work(self, seconds: float) -> bool:
        return False  # a simulated device has no cache to prefault

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        if self.inner is not None:
            self.inner.shutdown()


@dataclass(frozen=True)
class SimulatedDevice:
    """A picklable recipe for a SimulatedDeviceExecutor (EngineCore's ``executor_factory``):
    ``real=True`` runs the model (a UniprocExecutor) on the device thread, else the fake model;
    ``runner=True``: the real runner's host work on the host thread, the device simulated."""

    device_seconds: float
    host_seconds: float = 0.0
    num_blocks: int = 1024
    real: bool = False
    max_concurrent_batches: int = 1
    runner: bool = False

    def __call__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> SimulatedDeviceExecutor:
        inner = None
        if self.real or self.runner:
            from pagedllm.executor.uniproc import UniprocExecutor

            inner = UniprocExecutor(config, hf_config, max_model_len, max_num_batched_tokens)
        return SimulatedDeviceExecutor(self.num_blocks, max_model_len, self.device_seconds, self.host_seconds,
                                       inner=inner, vocab_size=hf_config.vocab_size,
                                       max_concurrent_batches=self.max_concurrent_batches, host_only=self.runner)
