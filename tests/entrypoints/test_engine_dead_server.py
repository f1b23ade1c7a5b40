"""After the engine dies (issue 29): every request gets 503 engine_dead whose body names no internal
path, port or exception text (those are in the server log), /health is 503, and /metrics says so
(engine_dead 1) instead of freezing at its last figures. And small boundary refusals: logit_bias
keys are decimal token ids only ("5_0", " 5", "+5" are 400s, not token 50 / 5)."""
from __future__ import annotations

import time

import httpx
import pytest

from conftest import ENGINE_KW, start_live
from pagedllm.sampling_params import SamplingParams

SECRET = "/very/internal/path/at/port/31337"


@pytest.mark.parametrize("key", ["5_0", " 5", "+5", "5.0", "\u0665", "1" * 11, ""])
def test_logit_bias_keys_are_decimal_token_ids(server, key):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "logit_bias": {key: 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={key: 1.0})


def test_plain_logit_bias_keys_still_work(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0, "logit_bias": {"50": 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert SamplingParams(logit_bias={"50": 1, 7: -1}).logit_bias == {50: 1.0, 7: -1.0}


def test_a_dead_engine_says_so_without_internals(llama_ckpt):
    from pagedllm.config import EngineConfig

    live = start_live(EngineConfig(model=llama_ckpt, served_model_name="tiny", **ENGINE_KW))
    try:
        metrics = httpx.get(live.url + "/metrics", timeout=30).text
        assert 'pagedllm:engine_dead{model_name="tiny"} 0.0' in metrics

        def die():  # outside every per-request isolation: the loop itself
            raise RuntimeError(f"socket {SECRET} refused")

        live.engine.engine.step = die
        first = httpx.post(live.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert first.status_code == 503, first.text
        deadline = time.monotonic() + 30
        while live.engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        later = httpx.post(live.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        for r in (first, later):
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            msg = r.json()["error"]["message"]
            assert SECRET not in msg and "RuntimeError" not in msg and "31337" not in msg, msg
        assert httpx.get(live.url + "/health", timeout=30).status_code == 503
        metrics = httpx.get(live.url + "/metrics", timeout=30)
        assert metrics.status_code == 200 and 'pagedllm:engine_dead{model_name="tiny"} 1.0' in metrics.text
    finally:
        live.stop()
        live.engine.shutdown()
