"""Every error is OpenAI-shaped JSON with the right status; bad input never 500s or hurts others."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import LiveServer, make_engine, wait_idle

PROMPT = "w11 w12 w13 w14 w15"


def assert_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def post(server, path, **kw):
    return httpx.post(server.url + path, timeout=30, **kw)


def completion(server, **body):
    return post(server, "/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body})


def chat(server, **body):
    return post(server, "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "w1"}], **body})


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 500}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"logprobs": 50}, "logprobs"),
    ({"top_k": -7}, "top_k"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"seed": 2**64}, "seed"),
])
def test_invalid_sampling_params_400(server, body, param):
    assert_error(completion(server, **body), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": [1]}, "n"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"stream": "maybe"}, "stream"),
])
def test_wrong_types_400(server, body, param):
    assert_error(completion(server, **body), 400, param=param, code="invalid_type")


def test_prompt_problems_400(server):
    assert_error(completion(server, max_tokens=252), 400, param="max_tokens", code="context_length_exceeded")
    assert_error(completion(server, prompt=" ".join(["w5"] * 300)), 400, param="prompt",
                 code="context_length_exceeded")
    assert_error(completion(server, prompt=[]), 400, param="prompt")
    assert_error(completion(server, prompt=[1, 2, 100000]), 400, param="prompt")
    assert_error(completion(server, prompt=[[]]), 400, param="prompt")
    assert_error(completion(server, suffix="x"), 400, param="suffix")
    missing = post(server, "/v1/completions", json={"model": "tiny"})
    assert_error(missing, 400, param="prompt")


def test_chat_problems_400(server):
    assert_error(chat(server, messages=[]), 400, param="messages")
    assert_error(chat(server, messages="hello"), 400, param="messages")
    assert_error(chat(server, messages=[{"content": "no role"}]), 400, param="messages")
    assert_error(chat(server, max_completion_tokens=1000), 400, param="max_completion_tokens",
                 code="context_length_exceeded")
    assert_error(chat(server, top_logprobs=3), 400, param="top_logprobs")
    assert_error(chat(server, logprobs=True, top_logprobs=30), 400, param="top_logprobs")
    err = assert_error(chat(server, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
                       param="messages[0].content[0].image_url")  # a text model (issue 34: LLaVA takes images)
    assert "takes no images" in err["message"]


def test_malformed_json_and_body_400(server):
    for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = post(server, "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert_error(r, 400)
    r = post(server, "/v1/chat/completions", content=b"{bad", headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_unknown_model_404_and_route_404(server):
    assert_error(completion(server, model="gpt-17"), 404, param="model", code="model_not_found")
    assert_error(chat(server, model="nope"), 404, param="model")
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    # the model may also be addressed by its directory name, or left out
    assert completion(server, model=None, max_tokens=2).status_code == 200


def test_extreme_values_do_not_kill_the_engine(server):
    for body in ({"top_k": 10**30}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"max_tokens": 10**30},
                 {"min_tokens": 3, "stop_token_ids": [10**30]}, {"n": 3, "seed": 2**63 - 1}):
        r = completion(server, **{"max_tokens": 3, **body})
        assert r.status_code in (200, 400), (body, r.text)
    for raw in ('"temperature": NaN', '"top_p": Infinity', '"logit_bias": {"3": -Infinity}', '"seed": 1e400'):
        r = post(server, "/v1/completions", content='{"prompt": "w1", "max_tokens": 2, %s}' % raw,
                 headers={"content-type": "application/json"})
        assert_error(r, 400)
    assert httpx.get(server.url + "/health").status_code == 200
    assert completion(server, max_tokens=2).status_code == 200


def test_bad_requests_do_not_disturb_good_ones(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:
            good = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            bad = [{"model": "tiny", "prompt": PROMPT, "temperature": -1},
                   {"model": "tiny", "prompt": [1, 2, 999999]},
                   {"model": "zzz", "prompt": PROMPT}]
            tasks = [h.post("/v1/completions", json=good) for _ in range(6)]
            tasks += [h.post("/v1/completions", json=b) for b in bad * 2]
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    goods, bads = results[:6], results[6:]
    assert all(r.status_code == 200 for r in goods)
    assert len({r.json()["choices"][0]["text"] for r in goods}) == 1
    assert sorted(r.status_code for r in bads) == [400, 400, 400, 400, 404, 404]
    wait_idle(server.engine)


# ---- API key ---------------------------------------------------------------------------------
def test_api_key(llama_ckpt, server):
    from pagedllm.entrypoints.openai.api_server import build_app

    live = LiveServer(build_app(server.engine, served_model_name="tiny", api_key="sekret"))
    try:
        url = live.url
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        assert_error(httpx.post(url + "/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        assert_error(httpx.post(url + "/tokenize", json={"prompt": "w1"}), 401)
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        import openai

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url + "/v1", api_key="sekret").models.list().data[0].id == "tiny"
    finally:
        live.stop()  # the shared engine is not owned by this app: it keeps running


# ---- overload and a dead engine: 503 ---------------------------------------------------------
def test_queue_full_429_and_dead_engine_503(llama_ckpt):
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = make_engine(llama_ckpt, max_num_seqs=1, max_waiting_requests=2)
    live = LiveServer(build_app(engine, served_model_name="tiny", owns_engine=True))
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
                return await asyncio.gather(*(h.post("/v1/completions", json=body) for _ in range(10)))

        results = asyncio.run(burst())
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) == 3 and codes.count(429) == 7, codes  # 1 running + 2 waiting
        for r in results:
            if r.status_code == 429:
                assert_error(r, 429, code="queue_full")
                assert r.headers["retry-after"] == "1"
        wait_idle(engine)
        assert httpx.post(live.url + "/v1/completions", json=body).status_code == 200  # recovered

        engine.dead_error = RuntimeError("simulated engine failure")
        assert_error(httpx.get(live.url + "/health"), 503, code="engine_dead")
        assert_error(httpx.post(live.url + "/v1/completions", json=body), 503, code="engine_dead")
        assert_error(httpx.post(live.url + "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "w1"}]}), 503)
        assert httpx.get(live.url + "/metrics").status_code == 200
    finally:
        engine.dead_error = None
        live.stop()
    deadline = time.monotonic() + 10
    while engine._thread.is_alive() and time.monotonic() < deadline:  # lifespan shutdown stopped it
        time.sleep(0.05)
    assert not engine._thread.is_alive()


def test_health_503_while_loading(llama_ckpt):
    """Built from a config, the app answers at once: 503 (loading) and then 200."""
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app
    from conftest import ENGINE_KW

    app = build_app(EngineConfig(model=llama_ckpt, **ENGINE_KW))
    state = app.state.server
    gate = __import__("threading").Event()
    original = state._load
    state._load = lambda: (gate.wait(30), original())  # hold the engine back until we saw the 503
    live = LiveServer(app)
    try:
        err = assert_error(httpx.get(live.url + "/health"), 503, code="loading")
        assert "loading" in err["message"]
        assert_error(httpx.post(live.url + "/v1/completions", json={"prompt": "w1"}), 503, code="loading")
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(live.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(live.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}).status_code == 200
    finally:
        gate.set()
        live.stop()
