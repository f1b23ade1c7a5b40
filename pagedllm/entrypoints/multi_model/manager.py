"""Which models are loaded: loading on first use, unloading under a memory budget and when idle.

States: unloaded -> loading -> loaded -> (draining ->) unloading -> unloaded; a load that fails
(the child exits or never answers /health 200) is ``failed``: its requests get that error, and a
request after ``retry_failed_s`` tries again.

Memory: each model's footprint is, before its first load, an estimate (a server process's own
memory as measured on the models loaded so far, its weight files' size and its KV cache size);
after, what it held once ready plus its whole KV cache; while loaded, never less than the most
its process tree has been measured to hold while serving this time (PSS). A load starts only when the loaded models' footprints plus the new one's fit in the budget.
To make room, idle models (no request in flight or waiting) are unloaded, least recently used
first; if that is not enough, least recently used busy ones are *drained*: they take no new
request, finish the ones in flight, then unload (a request is never cut by an unload). Pinned
models are never unloaded. A model that cannot fit even with every unpinned one gone is answered
503 at once. Loads are served first come, first served; requests wait for their model, bounded
by their deadline (503 with Retry-After when it passes).

All state is changed on the event loop's thread; process starts, stops and memory reads run in
worker threads.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from pagedllm.entrypoints.multi_model.catalog import ModelEntry
from pagedllm.entrypoints.multi_model.process import ModelProcess

logger = logging.getLogger("pagedllm.entrypoints.multi_model")

MiB = 1 << 20


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"
    UNLOADING = "unloading"
    FAILED = "failed"


HOLDS_MEMORY = (ModelState.LOADING, ModelState.LOADED, ModelState.DRAINING, ModelState.UNLOADING)


@dataclass(frozen=True)
class ManagerSettings:
    memory_budget: int  # bytes all loaded models together may hold
    kv_cache_bytes: int  # each model's KV cache unless its options say otherwise
    idle_timeout_s: Optional[float] = None  # unload a model idle this long (None: never)
    load_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0  # an unloading server's drain before it is killed
    retry_failed_s: float = 30.0
    runtime_bytes: int = 512 * MiB  # one server process before weights and KV cache, until measured
    monitor_interval_s: float = 1.0


class ModelUnavailable(Exception):
    """A request's model cannot serve it: an HTTP status, a message and an error code."""

    def __init__(self, status: int, message: str, code: str, retry_after: Optional[int] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


class ServedModel:
    """One catalog entry's runtime state (written by the ModelManager only)."""

    def __init__(self, entry: ModelEntry, kv_cache_bytes: int) -> None:
        self.entry = entry
        self.state = ModelState.UNLOADED
        self.process: Optional[ModelProcess] = None
        self.url: Optional[str] = None
        self.in_flight = 0
        self.waiting = 0
        self.last_used = 0.0  # monotonic time of the last request started (or of the load)
        self.kv_cache_bytes = kv_cache_bytes
        self.weight_bytes = entry.weight_bytes()
        self.memory_bytes = 0  # measured now (PSS of the process tree)
        self.measured_peak = 0  # the most it was measured to hold while serving, this load
        self.load_peak = 0  # what it held once ready (weights, runtime; KV pages barely touched yet), over its loads
        self.max_model_len: Optional[int] = None
        self.error: Optional[str] = None
        self.failed_at = 0.0
        self.loads = 0
        self.load_failures = 0
        self.unloads: Counter[str] = Counter()  # reason -> count
        self.load_seconds: list[float] = []
        self.unservable: Optional[str] = None

    @property
    def name(self) -> str:
        return self.entry.name

    def estimate(self, runtime_bytes: int) -> int:
        return runtime_bytes + self.weight_bytes + self.kv_cache_bytes

    def footprint(self, runtime_bytes: int) -> int:
        """What the budget counts for this model: once it has loaded, what it held when ready plus
        its whole KV cache (whose pages it takes as requests use them); before, the estimate;
        never less than the most it was measured to hold."""
        counted = self.load_peak + self.kv_cache_bytes if self.load_peak else self.estimate(runtime_bytes)
        return max(counted, self.measured_peak)

    def idle(self) -> bool:
        return self.state is ModelState.LOADED and self.in_flight == 0 and self.waiting == 0 and not self.entry.pinned


class ModelManager:
    def __init__(self, entries: list[ModelEntry], settings: ManagerSettings,
                 launch: Callable[[ModelEntry, ServedModel], tuple[ModelProcess, str]], client) -> None:
        """``launch(entry, model)`` starts a model's server and returns it with its base URL;
        ``client``: an httpx.AsyncClient for the health checks."""
        self.settings = settings
        self.models = {e.name: ServedModel(e, _kv_bytes(e, settings.kv_cache_bytes)) for e in entries}
        self._launch = launch
        self.client = client
        self._queue: list[ServedModel] = []  # loads wanted, first come first served
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._measured_runtime: Optional[int] = None
        self.peak_total = 0  # the most the loaded models were measured to hold together
        self.closing = False

    # ---- accounting --------------------------------------------------------------------------
    @property
    def runtime_bytes(self) -> int:
        return self._measured_runtime or self.settings.runtime_bytes

    def held(self) -> int:
        """The footprints of the models holding memory (loading, loaded, draining, unloading)."""
        return sum(m.footprint(self.runtime_bytes) for m in self.models.values() if m.state in HOLDS_MEMORY)

    def measured_total(self) -> int:
        return sum(m.memory_bytes for m in self.models.values() if m.state in HOLDS_MEMORY)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self._wake.set()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for m in self.models.values():
            if m.entry.pinned:
                self._want(m)
        self._tasks = [asyncio.create_task(self._schedule_loop()), asyncio.create_task(self._monitor_loop())]

    async def close(self) -> None:
        self.closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        procs = [m.process for m in self.models.values() if m.process is not None]
        for p in procs:
            p.terminate()  # all drain together
        await asyncio.gather(*(asyncio.to_thread(p.stop, self.settings.stop_timeout_s) for p in procs))

    # ---- requests ----------------------------------------------------------------------------
    async def acquire(self, m: ServedModel, deadline: float) -> None:
        """Wait until ``m`` is loaded and count a request in flight on it (``release`` ends it)."""
        if m.state is ModelState.UNLOADED:
            m.unservable = None  # judged again for this request (other models may have gone since)
        while True:
            if self.closing:
                raise ModelUnavailable(503, "the server is shutting down", "shutting_down")
            if m.state is ModelState.LOADED:
                m.in_flight += 1
                m.last_used = time.monotonic()
                return
            now = time.monotonic()
            if m.state is ModelState.FAILED and now - m.failed_at < self.settings.retry_failed_s:
                raise ModelUnavailable(500, f"the model `{m.name}` failed to load: {m.error}", "model_load_failed")
            if m.state in (ModelState.UNLOADED, ModelState.FAILED):
                self._want(m)
            if m.unservable is not None:
                raise ModelUnavailable(503, m.unservable, "model_does_not_fit", retry_after=30)
            if now >= deadline:
                raise ModelUnavailable(503, f"the model `{m.name}` is {m.state.value} and did not become ready "
                                            "within the request's deadline; retry later", "model_not_ready",
                                       retry_after=max(1, int(self.settings.load_timeout_s / 10)))
            changed = self._changed
            m.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), deadline - now)
            except asyncio.TimeoutError:
                pass
            finally:
                m.waiting -= 1

    def release(self, m: ServedModel) -> None:
        m.in_flight -= 1
        m.last_used = time.monotonic()
        if m.in_flight == 0:
            self._wake.set()

    # ---- loading and unloading ---------------------------------------------------------------
    def _want(self, m: ServedModel) -> None:
        if m not in self._queue:
            if m.state is ModelState.FAILED:
                m.state = ModelState.UNLOADED
            self._queue.append(m)
            self._wake.set()

    async def _schedule_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._schedule()
            except Exception:  # keep scheduling: one bad decision must not stop every model
                logger.exception("multi-model scheduler")

    def _schedule(self) -> None:
        for m in self.models.values():  # a drained model unloads once its last request ends
            if m.state is ModelState.DRAINING and m.in_flight == 0:
                self._begin_unload(m, "memory")
        self._queue = [m for m in self._queue if m.state is ModelState.UNLOADED and (m.waiting or m.entry.pinned)]
        if not self._queue or any(m.state is ModelState.LOADING for m in self.models.values()):
            return
        head = self._queue[0]
        runtime, budget = self.runtime_bytes, self.settings.memory_budget
        need = head.footprint(runtime)
        pinned = sum(m.footprint(runtime) for m in self.models.values()
                     if m.entry.pinned and m is not head and m.state in HOLDS_MEMORY)
        if need + pinned > budget:
            head.unservable = (f"the model `{head.name}` needs about {need // MiB} MiB and the models memory budget "
                               f"is {budget // MiB} MiB ({pinned // MiB} MiB of it held by pinned models): "
                               "raise --models-memory or lower its kv_cache_memory")
            self._queue.pop(0)
            self._notify()
            return
        free = budget - self.held()
        if free >= need:
            self._queue.pop(0)
            head.state = ModelState.LOADING
            asyncio.create_task(self._load(head))
            return
        self._make_room(need - free, runtime)

    def _make_room(self, short: int, runtime: int) -> None:
        """Unload idle models (least recently used first); if that is not enough, drain busy ones.
        Models already draining or unloading count as room on its way."""
        freeing = sum(m.footprint(runtime) for m in self.models.values()
                      if m.state in (ModelState.DRAINING, ModelState.UNLOADING))
        idle = sorted((m for m in self.models.values() if m.idle()), key=lambda m: m.last_used)
        # a loaded model whose waiters have not yet taken it is left to serve them first
        busy = sorted((m for m in self.models.values() if m.state is ModelState.LOADED and m.in_flight
                       and not m.waiting and not m.entry.pinned), key=lambda m: m.last_used)
        for m in idle + busy:
            if freeing >= short:
                break
            if m.idle():
                self._begin_unload(m, "memory")
            else:
                logger.info("model %s: draining (%d in flight) to make room", m.name, m.in_flight)
                m.state = ModelState.DRAINING  # takes no new request; unloads when its last one ends
                self._changed.set()
                self._changed = asyncio.Event()
            freeing += m.footprint(runtime)

    async def _load(self, m: ServedModel) -> None:
        import httpx

        t0 = time.monotonic()
        logger.info("model %s: loading %s", m.name, m.entry.path)
        try:
            m.process, m.url = await asyncio.to_thread(self._launch, m.entry, m)
        except Exception as e:  # noqa: BLE001 (a launch that fails is that model's failure only)
            return self._failed(m, f"{type(e).__name__}: {e}")
        deadline = t0 + self.settings.load_timeout_s
        while True:
            if m.process.exited() is not None:
                summary = await asyncio.to_thread(m.process.error_summary)
                return self._failed(m, f"its server exited with code {m.process.exited()}: {summary}")
            try:
                if (await self.client.get(f"{m.url}/health", timeout=2.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            # what it holds while loading is shown, not counted: a one-off (a first start building the
            # CPU kernels runs a compiler in its tree) must not count against the model for good
            m.memory_bytes = await asyncio.to_thread(m.process.memory_bytes)
            if time.monotonic() > deadline:
                await asyncio.to_thread(m.process.stop, 5.0)
                return self._failed(m, f"it was not ready within --model-load-timeout {self.settings.load_timeout_s:g} s")
            await asyncio.sleep(0.1)
        m.max_model_len = await self._max_model_len(m)
        seconds = time.monotonic() - t0
        m.memory_bytes = await asyncio.to_thread(m.process.memory_bytes)
        m.load_peak = max(m.load_peak, m.memory_bytes)
        m.measured_peak = max(m.measured_peak, m.load_peak)
        runtime = max(0, m.load_peak - m.weight_bytes)  # a server process's own share (for models not loaded yet)
        self._measured_runtime = max(self._measured_runtime or 0, runtime)
        m.state, m.error, m.unservable = ModelState.LOADED, None, None
        m.loads += 1
        m.load_seconds.append(seconds)
        m.last_used = time.monotonic()
        logger.info("model %s: loaded in %.2f s (%d MiB)", m.name, seconds, m.memory_bytes // MiB)
        self._notify()

    async def _max_model_len(self, m: ServedModel) -> Optional[int]:
        try:
            cards = (await self.client.get(f"{m.url}/v1/models", timeout=5.0)).json()["data"]
            return next((c.get("max_model_len") for c in cards if c.get("id") == m.name), None)
        except Exception:  # noqa: BLE001 (only a field of /v1/models)
            return None

    def _failed(self, m: ServedModel, why: str) -> None:
        logger.error("model %s: failed to load: %s", m.name, why)
        m.state, m.error, m.failed_at = ModelState.FAILED, why, time.monotonic()
        m.process, m.url = None, None
        m.load_failures += 1
        self._notify()

    def _begin_unload(self, m: ServedModel, reason: str) -> None:
        m.state = ModelState.UNLOADING
        asyncio.create_task(self._unload(m, reason))

    async def _unload(self, m: ServedModel, reason: str) -> None:
        t0 = time.monotonic()
        proc = m.process
        if proc is not None:
            await asyncio.to_thread(proc.stop, self.settings.stop_timeout_s)
        m.state, m.process, m.url, m.memory_bytes = ModelState.UNLOADED, None, None, 0
        m.measured_peak = 0  # its next load is judged by what it held once ready (load_peak), not by this one's peaks
        m.unloads[reason] += 1
        logger.info("model %s: unloaded (%s) in %.2f s", m.name, reason, time.monotonic() - t0)
        self._notify()

    # ---- the monitor: memory, idle models, servers that died ---------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.monitor_interval_s)
            try:
                await self._monitor()
            except Exception:  # noqa: BLE001
                logger.exception("multi-model monitor")

    async def _monitor(self) -> None:
        live = [m for m in self.models.values() if m.state in HOLDS_MEMORY and m.process is not None]
        sizes = await asyncio.to_thread(lambda: [m.process.memory_bytes() if m.process else 0 for m in live])
        for m, size in zip(live, sizes):
            m.memory_bytes = size
            if m.state in (ModelState.LOADED, ModelState.DRAINING):  # serving (a load's transients aside)
                m.measured_peak = max(m.measured_peak, size)
        self.peak_total = max(self.peak_total, self.measured_total())
        now = time.monotonic()
        for m in list(self.models.values()):
            if m.state is ModelState.LOADED and m.process is not None and m.process.exited() is not None:
                logger.error("model %s: its server exited (code %s): %s", m.name, m.process.exited(),
                             await asyncio.to_thread(m.process.error_summary))
                m.state, m.process, m.url, m.memory_bytes = ModelState.UNLOADED, None, None, 0
                m.unloads["exited"] += 1
                self._notify()
            elif m.idle() and self.settings.idle_timeout_s is not None and now - m.last_used >= self.settings.idle_timeout_s:
                self._begin_unload(m, "idle")
        if self.measured_total() > self.settings.memory_budget:  # grew past the budget while serving
            over = self.measured_total() - self.settings.memory_budget
            for m in sorted((m for m in self.models.values() if m.idle()), key=lambda m: m.last_used):
                if over <= 0:
                    break
                logger.warning("models hold %d MiB, over the %d MiB budget: unloading idle %s",
                               self.measured_total() // MiB, self.settings.memory_budget // MiB, m.name)
                self._begin_unload(m, "memory")
                over -= m.memory_bytes
        self._wake.set()


def _kv_bytes(entry: ModelEntry, default: int) -> int:
    from pagedllm.config import parse_size

    given = entry.options.get("kv_cache_memory", entry.options.get("kv-cache-memory"))
    return parse_size(str(given)) if given is not None else default
