"""Compile budgets through the server (issue 29): over-limit constraints and tool lists are 400s
naming the limit; a compile past structured_compile_timeout is a 408; a full compile pool is a
429; and while every compile worker is stuck, tokenization and unconstrained requests still run
(compiles have a pool of their own)."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("xgrammar")

from conftest import ENGINE_KW, start_live, wait_idle  # noqa: E402
from pagedllm.structured_output import backend as backend_mod  # noqa: E402


@pytest.fixture(scope="module")
def live(default_model):
    from pagedllm.config import EngineConfig

    # The core in this process and compiles on its threads, so the tests can stall them (a core
    # process compiles in its own manager the same way: test_structured_server.py; compile
    # worker processes: tests/structured_output/test_compile_process.py)
    server = start_live(EngineConfig(model=default_model, served_model_name="tiny", structured_compile_workers=1,
                                     structured_max_queued_compiles=1, structured_compile_timeout=1.0, max_tools=8,
                                     structured_compile_isolation="thread", engine_core_process=False,
                                     **dict(ENGINE_KW, kv_cache_memory=32 << 20)))
    yield server
    server.stop()


def post(live, body, route="/v1/completions", timeout=60):
    return httpx.post(live.url + route, json={"model": "tiny", **body}, timeout=timeout)


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}


def test_too_many_tools_is_400(live):
    r = post(live, {"messages": [{"role": "user", "content": "hi"}], "tools": [tool(i) for i in range(9)],
                    "tool_choice": "required", "max_tokens": 4}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "max_tools" in r.text, r.text


@pytest.mark.parametrize("body, param, limit", [
    ({"guided_choice": ["y" * 70_000]}, "guided_choice", "structured_max_bytes"),
    ({"guided_choice": [str(i) for i in range(2000)]}, "guided_choice", "structured_max_alternatives"),
    ({"guided_json": json.loads('{"type": "array", "items": ' * 900 + "{}" + "}" * 900)}, "guided_json",
     "structured_max_depth"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(5000))}}}},
     "response_format", "structured_max_alternatives"),
    ({"guided_grammar": "root ::= a\na ::= root"}, "guided_grammar", "no rule reaches a terminal"),  # was a 500
])
def test_over_limit_constraints_are_400_naming_the_limit(live, body, param, limit):
    r = post(live, {"prompt": "To be", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and limit in err["message"] and err["message"].startswith(param), err


def test_stuck_compiles_time_out_fill_the_pool_and_starve_nobody(live, monkeypatch):
    release = threading.Event()
    real = backend_mod.GrammarBackend._compile

    def stuck(backend, key):
        release.wait(60)
        return real(backend, key)

    monkeypatch.setattr(backend_mod.GrammarBackend, "_compile", stuck)
    try:
        with ThreadPoolExecutor(2) as pool:  # one compile running (stuck), one queued: the pool is full
            first = pool.submit(post, live, {"prompt": "a", "max_tokens": 2, "guided_regex": "[a-c]{3}x"})
            second = pool.submit(post, live, {"prompt": "a", "max_tokens": 2, "guided_regex": "[a-c]{3}y"})
            time.sleep(0.3)
            third = post(live, {"prompt": "a", "max_tokens": 2, "guided_regex": "[a-c]{3}z"})
            assert third.status_code == 429 and third.json()["error"]["code"] == "compile_queue_full", third.text
            # tokenization and unconstrained generation do not wait for compiles
            tok = httpx.post(live.url + "/tokenize", json={"model": "tiny", "prompt": "hello there"}, timeout=30)
            assert tok.status_code == 200, tok.text
            plain = post(live, {"prompt": "To be", "max_tokens": 2})
            assert plain.status_code == 200, plain.text
            for f in (first, second):
                r = f.result(60)
                assert r.status_code == 408, r.text
                err = r.json()["error"]
                assert err["code"] == "compile_timeout" and err["param"] == "guided_regex"
                assert "structured_compile_timeout" in err["message"]
    finally:
        release.set()
    deadline = time.monotonic() + 30
    manager = live.engine.engine.input_processor.structured  # the core's compiles (the server awaits them)
    while manager.num_inflight_compiles and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.num_inflight_compiles == 0
    ok = post(live, {"prompt": "a", "max_tokens": 4, "guided_regex": "[a-c]{3}x"})  # compiled after all: cached
    assert ok.status_code == 200 and set(ok.json()["choices"][0]["text"]) <= set("abcx"), ok.text
    wait_idle(live.engine)
