"""/dashboard: a live page of the engine (``--enable-dashboard``; behind ``--api-key`` as the API).

- ``GET /dashboard``: the page (static files of ``dashboard_static/``, served from here: no CDN, no
  build step); ``GET /dashboard/static/NAME``: its script and style.
- ``GET /dashboard/api/state``: one snapshot as JSON; ``GET /dashboard/events``: server-sent events,
  a snapshot a second (the page falls back to polling the former if the stream breaks).

The snapshot (``engine_snapshot``) is the one place that reads the engine: its public stats, the
scheduler's running and waiting requests, and the KV cache manager's per-block states and block
ids -- public methods and attributes only, so the engine's internals can change under it. Step
history (step time, batch size, tokens per step) comes from ``DashboardRecorder``, chained onto
AsyncLLM's ``on_step`` / ``on_finished`` callbacks like the Prometheus metrics: bounded deques
written on the engine thread, read here.

A browser cannot send a bearer token when it opens a page, so with ``--api-key`` the dashboard's
paths also take HTTP Basic credentials whose password is the key (the browser asks for them).
"""
from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import time
from typing import Any, Optional

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboard_static")
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
HISTORY_SECONDS = 300  # step charts cover the last five minutes
MAX_MAP_CELLS = 16384  # larger caches are drawn with several blocks per cell
STATE_NAMES = ("free", "cached", "in_use", "shared")  # block_pool.BLOCK_* order


class DashboardRecorder:
    """Step history and recently finished requests, fed on the engine thread."""

    def __init__(self, max_steps: int = 50_000, max_finished: int = 50) -> None:
        self.steps: collections.deque = collections.deque(maxlen=max_steps)  # (t, seconds, batch, tokens)
        self.finished: collections.deque = collections.deque(maxlen=max_finished)
        self._last_tokens: Optional[int] = None

    def attach(self, engine) -> None:
        from pagedllm.metrics.engine_callbacks import chain_engine_callbacks

        chain_engine_callbacks(engine, self.on_step, self.on_finished)
        self._last_tokens = engine.stats.num_scheduled_tokens_total

    def on_step(self, stats, seconds: float) -> None:
        total = stats.num_scheduled_tokens_total
        tokens = total - self._last_tokens if self._last_tokens is not None else 0
        self._last_tokens = total
        self.steps.append((time.time(), seconds, stats.num_running, tokens))

    def on_finished(self, out) -> None:
        m = out.metrics or {}
        generated = m.get("num_generated_tokens")  # the outputs hold only the last delta when streaming
        arrival, last = m.get("arrival_time"), m.get("last_token_time")
        reasons = sorted({c.finish_reason for c in out.outputs if c.finish_reason})
        self.finished.append({"id": out.request_id, "finished_at": time.time(),
                              "finish_reason": ",".join(reasons) or "finished",
                              "prompt_tokens": len(out.prompt_token_ids or ()),
                              "output_tokens": generated if generated is not None
                              else sum(len(c.token_ids) for c in out.outputs),
                              "latency_s": last - arrival if arrival is not None and last is not None else None})

    def history(self, now: float, window: float = HISTORY_SECONDS) -> list[dict]:
        """Per-second buckets of the last ``window`` seconds with steps: mean step time, batch size
        and tokens per step."""
        buckets: dict[int, list] = {}
        for t, seconds, batch, tokens in list(self.steps):
            if now - t > window:
                continue
            b = buckets.setdefault(int(t), [0, 0.0, 0, 0])
            b[0] += 1
            b[1] += seconds
            b[2] += batch
            b[3] += tokens
        return [{"t": sec, "steps": n, "step_ms": 1000 * s / n, "batch_size": batch / n, "tokens_per_step": tok / n}
                for sec, (n, s, batch, tok) in sorted(buckets.items())]


_DIGITS = bytes.maketrans(b"\x00\x01\x02\x03", b"0123")


def _block_map(states: bytes) -> dict:
    """Counts per state and the map's cells as a string of digits (the BLOCK_* codes)."""
    counts = [states.count(code) for code in range(4)]
    per_cell = max(1, math.ceil(len(states) / MAX_MAP_CELLS))
    if per_cell == 1:
        cells = states
    else:  # a cell shows the busiest state among its blocks (shared > in use > cached > free)
        cells = bytes(max(states[i:i + per_cell]) for i in range(0, len(states), per_cell))
    n = len(states)
    return {"num_blocks": n, "blocks_per_cell": per_cell, "cells": cells.translate(_DIGITS).decode("ascii"),
            "counts": dict(zip(STATE_NAMES, counts)),
            "utilization": (counts[2] + counts[3]) / n if n else 0.0}


def engine_snapshot(engine, recorder: Optional[DashboardRecorder]) -> dict:
    """What the page shows, from the engine's public state (see the module doc)."""
    now_wall, now = time.time(), time.monotonic()
    stats = engine.stats
    snap = engine.core_snapshot()  # the scheduler's requests and the KV block map (EngineCore.snapshot)
    running, waiting, states = snap["running"], snap["waiting"], snap["block_states"]

    def describe(req: dict) -> dict:
        arrival = req.pop("arrival_time")
        return {**req, "age_s": round(now - arrival, 3)}

    queries = stats.prefix_cache_queries
    kv_map = _block_map(states)
    kv_map.update(block_size=engine.config.block_size, prefix_caching=bool(engine.config.enable_prefix_caching),
                  prefix_cache_queries=queries, prefix_cache_hits=stats.prefix_cache_hits,
                  prefix_cache_hit_rate=stats.prefix_cache_hits / queries if queries else None)
    finished = []
    if recorder is not None:
        for f in reversed(list(recorder.finished)):
            finished.append({**f, "age_s": round(now_wall - f["finished_at"], 3)})
    history = recorder.history(now_wall) if recorder is not None else []
    return {"time": now_wall, "status": "ready" if engine.is_running else "dead",
            "num_running": len(running), "num_waiting": len(waiting),
            "requests": [describe(r) for r in running] + [describe(r) for r in waiting],
            "finished": finished, "kv_cache": kv_map,
            "steps": {"window_s": HISTORY_SECONDS, "total": stats.num_steps, "series": history,
                      "preemptions": stats.num_preemptions}}


def not_ready_snapshot(load_error: Optional[BaseException]) -> dict:
    return {"time": time.time(), "status": "failed" if load_error is not None else "loading",
            "num_running": 0, "num_waiting": 0, "requests": [], "finished": [], "kv_cache": None, "steps": None}


# The page loads only its own script and stylesheet and talks only to this server; it may not be
# framed (clickjacking) and nothing it shows is sniffed into another type.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def add_dashboard_routes(app, state) -> None:
    """The /dashboard routes on the server's app (``state``: its ServerState)."""
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

    def snapshot() -> dict:
        if state.engine is None or state.serving is None:
            return not_ready_snapshot(state.load_error)
        return engine_snapshot(state.engine, state.dashboard)

    def read(name: str) -> bytes:
        with open(os.path.join(STATIC_DIR, name), "rb") as f:
            return f.read()

    @app.get("/dashboard")
    async def dashboard_page():
        return HTMLResponse(read("index.html"), headers=PAGE_HEADERS)

    @app.get("/dashboard/static/{name}")
    async def dashboard_static(name: str):
        if name not in STATIC_FILES:
            return JSONResponse({"error": {"message": f"no such dashboard file: {name!r}", "type": "not_found",
                                           "code": "not_found"}}, status_code=404)
        return Response(read(name), media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

    @app.get("/dashboard/api/state")
    async def dashboard_state():
        return JSONResponse(await asyncio.to_thread(snapshot))  # a core process answers within a step

    @app.get("/dashboard/events")
    async def dashboard_events(interval: float = 1.0):
        interval = min(10.0, max(0.2, interval))

        async def events():
            while True:
                if state.draining:
                    return
                yield f"data: {json.dumps(await asyncio.to_thread(snapshot))}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def attach_recorder(engine: Any) -> DashboardRecorder:
    recorder = DashboardRecorder()
    recorder.attach(engine)
    return recorder
