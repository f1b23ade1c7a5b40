"""The server over an engine core in its own process: the core's death is seen within a second
(/health 503 engine_dead, an open stream ends with an error event and [DONE], new requests 503),
and the server's shutdown stops the core process."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from processes import alive
from conftest import ENGINE_KW, LiveServer


def test_killed_core_process_turns_health_503_and_ends_streams(llama_ckpt):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.executor.simulated import SimulatedDevice

    config = EngineConfig(model=llama_ckpt, **ENGINE_KW)
    # the real model, 20 ms a step at least: the stream is still open when the core is killed
    engine = AsyncLLM(config, LLMEngine(config, multiprocess=True,
                                        executor_factory=SimulatedDevice(0.02, real=True)))
    pid = engine.engine.client.pid
    live = LiveServer(build_app(engine, served_model_name="tiny", owns_engine=True))
    try:
        assert httpx.get(live.url + "/health").status_code == 200
        first, result = threading.Event(), {"lines": []}

        def stream():
            body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 200, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        result["lines"].append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(live.url + "/health").status_code != 503:
            assert time.monotonic() - t0 < 1.0, "a dead core was not seen within a second"
            time.sleep(0.02)
        body = httpx.get(live.url + "/health").json()
        assert body["error"]["code"] == "engine_dead"
        t.join(10)
        assert not t.is_alive(), "the open stream hung on a dead core"
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "engine_dead", err
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(live.url + "/metrics").status_code == 200
    finally:
        live.stop()


def test_server_shutdown_stops_the_core_process(llama_ckpt):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(EngineConfig(model=llama_ckpt, **ENGINE_KW), multiprocess=True)
    pid = engine.engine.client.pid
    live = LiveServer(build_app(engine, served_model_name="tiny", owns_engine=True))
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(live.url + "/metrics").text
    assert 'engine_step_phase_seconds_count{model_name="tiny",phase="execute"}' in metrics
    live.stop()
    deadline = time.monotonic() + 15
    while alive(pid):
        assert time.monotonic() < deadline, "the core process outlived the server"
        time.sleep(0.05)
