"""/dashboard: off by default, behind --api-key (bearer, or Basic with the key as password for a
browser), the snapshot's content, and -- in real headless Chromium -- the page showing requests
running, then finished, and the block map changing."""
from __future__ import annotations

import base64
import os
import sys
import tempfile
import threading
import time

import httpx
import pytest

from conftest import LiveServer, make_engine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "dash-key"


class SteppingGate:
    """Holds the engine before each step until the test lets one through (or all of them), so
    what the page must show is held still, whatever the machine's speed."""

    def __init__(self, llm_engine) -> None:
        self.permits = threading.Semaphore(0)
        self.free = False
        self.steps = 0
        self._step = llm_engine.step

        def step():
            if not self.free:
                self.permits.acquire()
            out = self._step()
            self.steps += 1
            return out

        llm_engine.step = step

    def one_step(self, timeout: float = 60.0) -> None:
        before = self.steps
        self.permits.release()
        deadline = time.monotonic() + timeout
        while self.steps == before:
            assert time.monotonic() < deadline, "the engine did not step"
            time.sleep(0.01)

    def open(self) -> None:
        self.free = True
        self.permits.release()


@pytest.fixture(scope="module")
def dash(llama_ckpt):
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    # the core in this process: the gate holds its steps
    engine = make_engine(llama_ckpt, multiprocess=False, enable_prefix_caching=True, max_num_seqs=4)
    gate = SteppingGate(engine.engine)
    live = LiveServer(build_app(engine, served_model_name="tiny", api_key=KEY,
                                args=ServerArgs(enable_dashboard=True)))
    live.gate = gate
    yield live
    gate.open()
    live.stop()
    engine.shutdown()


def basic(password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"anyone:{password}".encode()).decode()}


def test_off_unless_enabled(server):
    assert httpx.get(server.url + "/dashboard").status_code == 404
    assert httpx.get(server.url + "/dashboard/api/state").status_code == 404


def test_behind_the_api_key(dash):
    r = httpx.get(dash.url + "/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(dash.url + "/dashboard", headers=basic("wrong")).status_code == 401
    assert httpx.get(dash.url + "/dashboard", headers={"Authorization": "Basic !!notbase64"}).status_code == 401
    page = httpx.get(dash.url + "/dashboard", headers=basic(KEY))
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'src="dashboard/static/dashboard.js"' in page.text and "http" not in page.text.split("<body>")[1]
    csp = page.headers["content-security-policy"]  # own script and style only, never framed
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    js = httpx.get(dash.url + "/dashboard/static/dashboard.js", headers={"Authorization": f"Bearer {KEY}"})
    assert js.status_code == 200 and "EventSource" in js.text
    assert httpx.get(dash.url + "/dashboard/static/../api_server.py", headers=basic(KEY)).status_code == 404
    assert httpx.get(dash.url + "/dashboard/static/secrets.txt", headers=basic(KEY)).status_code == 404
    # Basic credentials open only the dashboard, not the API
    assert httpx.get(dash.url + "/v1/models", headers=basic(KEY)).status_code == 401


def test_snapshot_and_events(dash):
    h = {"Authorization": f"Bearer {KEY}"}
    s = httpx.get(dash.url + "/dashboard/api/state", headers=h).json()
    assert s["status"] == "ready" and s["num_running"] == 0 and s["requests"] == []
    kv = s["kv_cache"]
    assert kv["num_blocks"] == len(kv["cells"]) == sum(kv["counts"].values()) and kv["blocks_per_cell"] == 1
    assert set(kv["cells"]) <= set("0123") and kv["prefix_caching"] is True
    with httpx.stream("GET", dash.url + "/dashboard/events", headers=h, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                import json

                assert json.loads(line[6:])["kv_cache"]["num_blocks"] == kv["num_blocks"]
                break


def test_recorder_history_and_large_maps():
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.dashboard import DashboardRecorder, _block_map

    rec = DashboardRecorder()
    rec._last_tokens = 0
    for total, running in ((10, 2), (14, 2), (20, 3)):
        rec.on_step(SimpleNamespace(num_scheduled_tokens_total=total, num_running=running), 0.5)
    series = rec.history(time.time())
    assert sum(p["steps"] for p in series) == 3
    assert sum(p["tokens_per_step"] * p["steps"] for p in series) == pytest.approx(20)
    assert rec.history(time.time() + 1000) == []  # older than the window
    m = _block_map(bytes([0] * 40000 + [2] * 10 + [1] * 5))
    assert m["counts"] == {"free": 40000, "cached": 5, "in_use": 10, "shared": 0}
    assert m["blocks_per_cell"] == 3 and len(m["cells"]) == 40015 // 3 + 1 and "2" in m["cells"]


@pytest.mark.slow
def test_page_in_headless_chromium(dash, tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from dashboard_demo import chromium_driver, chromium_missing

    why = chromium_missing()
    if why:
        pytest.skip(f"headless Chromium unavailable: {why}")
    from selenium.webdriver.support.ui import WebDriverWait

    def page(driver) -> dict:
        """What the page shows now, read in one go (it re-renders every second)."""
        return driver.execute_script("""
            const rows = (sel) => [...document.querySelectorAll(sel)].map(
                (tr) => ({id: tr.dataset.id, cells: [...tr.cells].map((td) => td.textContent)}));
            const t = (id) => document.getElementById(id).textContent;
            return {status: t("status"), running: t("running-count"), waiting: t("waiting-count"),
                    requests: rows('#requests tr[data-state="running"]'), finished: rows("#finished tbody tr"),
                    cells: document.getElementById("block-map").dataset.cells, shared: t("kv-shared"),
                    summary: t("kv-summary")};""")

    results = []

    def complete(i):
        body = {"model": "tiny", "prompt": [7, 8, 9, 10] * 8 + [11 + i], "max_tokens": 6, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", dash.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            results.append((r.status_code, sum(1 for line in r.iter_lines() if line.startswith("data: {"))))

    with tempfile.TemporaryDirectory() as profile:
        driver = chromium_driver(profile)
        try:
            driver.get(dash.url.replace("://", f"://user:{KEY}@") + "/dashboard")
            wait = WebDriverWait(driver, 60, poll_frequency=0.2)
            idle = wait.until(lambda d: (lambda p: p if p["running"] == "0 running" and p["cells"] else None)(page(d)))
            assert idle["status"] == "ready" and set(idle["cells"]) == {"0"}

            threads = [threading.Thread(target=complete, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            # step the engine, one step at a time, until all three are running (and held there)
            deadline = time.monotonic() + 60
            while True:
                snap = httpx.get(dash.url + "/dashboard/api/state", headers={"Authorization": f"Bearer {KEY}"}).json()
                if snap["num_running"] == 3:
                    break
                assert time.monotonic() < deadline, snap
                if snap["num_running"] + snap["num_waiting"]:
                    dash.gate.one_step()
                else:
                    time.sleep(0.05)
            busy = wait.until(lambda d: (lambda p: p if p["running"] == "3 running" else None)(page(d)))
            assert len(busy["requests"]) == 3 and all(r["cells"][1] == "running" for r in busy["requests"])
            assert busy["cells"] != idle["cells"] and "2" in busy["cells"]
            assert "3" in busy["cells"] and busy["shared"] != "0 shared"  # the shared 32-token prompt prefix
            driver.save_screenshot(str(tmp_path / "running.png"))

            dash.gate.open()
            for t in threads:
                t.join(120)
            assert results == [(200, 6)] * 3, results
            done = wait.until(lambda d: (lambda p: p if p["running"] == "0 running" and len(p["finished"]) >= 3
                                         and "2" not in p["cells"] else None)(page(d)))
            ids = {r["id"] for r in busy["requests"]}
            finished = [r for r in done["finished"] if r["id"] in ids]
            assert len(finished) == 3 and all(r["cells"][1].startswith("finished (length)") for r in finished)
            assert all(r["cells"][-1] == "6" for r in finished)  # output tokens
            assert "3" not in done["cells"] and "1" in done["cells"]  # freed; the prompts' blocks stay cached
            assert "prefix cache hit rate" in done["summary"]
            driver.save_screenshot(str(tmp_path / "finished.png"))
        finally:
            driver.quit()
