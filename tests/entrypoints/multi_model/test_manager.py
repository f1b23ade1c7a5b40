"""The model manager over fake model servers: loads on first use, the memory budget never
exceeded while clients interleave across more models than fit, idle and memory unloads, pinned
models kept, a busy model drained (never cut), a failed load answered for that model only."""
import asyncio
import random

import httpx
import pytest

from pagedllm.entrypoints.multi_model.catalog import ModelEntry
from pagedllm.entrypoints.multi_model.manager import (
    HOLDS_MEMORY, ManagerSettings, ModelManager, ModelState, ModelUnavailable,
)

MiB = 1 << 20


class FakeServer:
    """A model server that is ready ``ready_after`` health checks after its start."""

    def __init__(self, name: str, memory: int, ready_after: int = 2, exit_code=None) -> None:
        self.name, self.memory, self.ready_after, self.code = name, memory, ready_after, exit_code
        self.checks, self.stopped = 0, False

    def exited(self):
        return 0 if self.stopped else self.code

    def memory_bytes(self):
        return 0 if self.stopped else self.memory

    def error_summary(self):
        return "ValueError: the checkpoint's config.json is not JSON"

    def terminate(self):
        self.stopped = True

    def stop(self, timeout):
        self.stopped = True


class Fleet:
    """The fake servers started, and a transport answering their /health and /v1/models."""

    def __init__(self, memory=100 * MiB, broken=(), slow=()) -> None:
        self.memory, self.broken, self.slow = memory, set(broken), set(slow)
        self.servers: dict[str, FakeServer] = {}
        self.started: list[str] = []
        self.budget_checks: list[tuple[int, int]] = []

    def launch(self, entry, model):
        name = entry.name
        server = FakeServer(name, self.memory, ready_after=10**9 if name in self.slow else 2,
                            exit_code=1 if name in self.broken else None)
        self.servers[name] = server
        self.started.append(name)
        return server, f"http://{name}"

    def handler(self, request: httpx.Request) -> httpx.Response:
        server = self.servers[request.url.host]
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": server.name, "max_model_len": 256}]})
        server.checks += 1
        return httpx.Response(200 if server.checks >= server.ready_after and not server.stopped else 503)


def _manager(fleet, names, budget, pinned=(), **kw):
    entries = [ModelEntry(path=f"/models/{n}", names=(n,), pinned=n in pinned) for n in names]
    settings = ManagerSettings(memory_budget=budget, kv_cache_bytes=0, runtime_bytes=fleet.memory,
                               monitor_interval_s=kw.pop("monitor_interval_s", 0.02), stop_timeout_s=1, **kw)
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.handler))
    return ModelManager(entries, settings, fleet.launch, client)


def _assert_within_budget(manager):
    held = sum(m.footprint(manager.runtime_bytes) for m in manager.models.values() if m.state in HOLDS_MEMORY)
    assert held <= manager.settings.memory_budget, {m.name: m.state for m in manager.models.values()}


async def until(condition, timeout: float = 120.0) -> None:
    """Wait for ``condition()``, bounded by a deadline (a busy host may be slow, never stuck)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _request(manager, name, hold=0.0, deadline=120.0):
    import time

    m = manager.models[name]
    await manager.acquire(m, time.monotonic() + deadline)
    try:
        assert m.state is ModelState.LOADED
        _assert_within_budget(manager)
        await asyncio.sleep(hold)
    finally:
        manager.release(m)


def test_interleaved_clients_over_three_models_where_two_fit():
    fleet = Fleet()

    async def main():
        manager = _manager(fleet, ["a", "b", "c"], budget=250 * MiB)
        manager.start()
        rng = random.Random(0)
        stop = asyncio.Event()

        async def watch():
            while not stop.is_set():
                _assert_within_budget(manager)
                assert sum(m.state is ModelState.LOADED for m in manager.models.values()) <= 2
                await asyncio.sleep(0.001)

        async def client(i):
            for _ in range(30):
                await _request(manager, rng.choice("abc"), hold=rng.random() * 0.01)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(i) for i in range(8)))
        stop.set()
        await watcher
        assert all(m.in_flight == 0 and m.waiting == 0 for m in manager.models.values())
        assert sum(m.unloads["memory"] for m in manager.models.values()) >= 1
        assert set(fleet.started) == {"a", "b", "c"}
        assert manager.models["a"].max_model_len == 256
        await manager.close()
        assert all(s.stopped for s in fleet.servers.values())

    asyncio.run(main())


def test_idle_models_unload_after_the_timeout_and_a_pinned_one_stays():
    fleet = Fleet()

    async def main():
        manager = _manager(fleet, ["a", "p"], budget=1000 * MiB, pinned=("p",), idle_timeout_s=0.1)
        manager.start()
        await _request(manager, "a")
        await _request(manager, "p")
        await until(lambda: manager.models["a"].state is ModelState.UNLOADED)
        assert manager.models["a"].unloads["idle"] == 1
        await asyncio.sleep(0.3)
        assert manager.models["p"].state is ModelState.LOADED and not manager.models["p"].unloads
        await _request(manager, "a")  # loaded again on its next request
        assert manager.models["a"].loads == 2
        await manager.close()

    asyncio.run(main())


def test_a_busy_model_is_drained_not_cut_and_pinned_ones_are_never_unloaded():
    fleet = Fleet()

    async def main():
        manager = _manager(fleet, ["a", "b", "p"], budget=250 * MiB, pinned=("p",))
        manager.start()
        a = manager.models["a"]
        import time

        await manager.acquire(a, time.monotonic() + 10)  # a request in flight on a, the whole time
        b_request = asyncio.create_task(_request(manager, "b"))
        await until(lambda: a.state is ModelState.DRAINING)
        assert a.state is ModelState.DRAINING and a.in_flight == 1 and not b_request.done()
        late_a = asyncio.create_task(_request(manager, "a"))  # waits: a takes no new request while draining
        await asyncio.sleep(0.1)
        assert not late_a.done() and a.in_flight == 1
        manager.release(a)  # its last request ends: now it unloads, b loads
        await asyncio.wait_for(b_request, 120)
        await asyncio.wait_for(late_a, 120)  # then b (idle) makes room for a again
        assert manager.models["p"].state is ModelState.LOADED and not manager.models["p"].unloads
        assert a.unloads["memory"] >= 1
        await manager.close()

    asyncio.run(main())


def test_a_failed_load_is_that_models_error_only_and_retried_later():
    fleet = Fleet(broken=("bad",))

    async def main():
        import time

        manager = _manager(fleet, ["good", "bad"], budget=1000 * MiB, retry_failed_s=0.2)
        manager.start()
        with pytest.raises(ModelUnavailable) as e:
            await manager.acquire(manager.models["bad"], time.monotonic() + 10)
        assert e.value.status == 500 and e.value.code == "model_load_failed"
        assert "`bad` failed to load" in e.value.message and "config.json is not JSON" in e.value.message
        await _request(manager, "good")
        with pytest.raises(ModelUnavailable):  # within retry_failed_s: the same error, no new start
            await manager.acquire(manager.models["bad"], time.monotonic() + 10)
        assert fleet.started.count("bad") == 1
        await asyncio.sleep(0.25)
        with pytest.raises(ModelUnavailable):
            await manager.acquire(manager.models["bad"], time.monotonic() + 10)
        assert fleet.started.count("bad") == 2 and manager.models["bad"].load_failures == 2
        await manager.close()

    asyncio.run(main())


def test_what_cannot_fit_is_503_at_once_and_a_deadline_bounds_the_wait():
    fleet = Fleet(slow=("slow",))

    async def main():
        import time

        manager = _manager(fleet, ["p", "a", "slow"], budget=150 * MiB, pinned=("p",))
        manager.start()
        await _request(manager, "p")
        with pytest.raises(ModelUnavailable) as e:  # p is pinned and a does not fit beside it
            await manager.acquire(manager.models["a"], time.monotonic() + 10)
        assert e.value.status == 503 and e.value.code == "model_does_not_fit" and e.value.retry_after
        manager.models["p"].entry = ModelEntry(path="/models/p", names=("p",))  # unpinned: p can make room
        t0 = time.monotonic()
        with pytest.raises(ModelUnavailable) as e:
            await manager.acquire(manager.models["slow"], time.monotonic() + 0.3)  # never ready
        assert e.value.status == 503 and e.value.code == "model_not_ready" and time.monotonic() - t0 < 60
        await manager.close()

    asyncio.run(main())
