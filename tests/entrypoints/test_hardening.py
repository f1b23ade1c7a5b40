"""Issue 14: no request can crash, stall or starve the server, and overload/shutdown behave as
operators expect. One app with ServerArgs over the shared engine (so no second model load)."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from conftest import LiveServer, make_engine, wait_idle
from test_openai_errors import assert_error

PROMPT = "w11 w12 w13 w14 w15"
MSGS = [{"role": "user", "content": "w1"}]


@pytest.fixture(scope="module")
def hard(server):
    """The shared engine behind a server with request templates trusted, a 1 s read timeout and
    vLLM's metric names."""
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    args = ServerArgs(trust_request_chat_template=True, chat_template_timeout=1.0, http_read_timeout=1.0,
                      metrics_prefix="vllm")
    live = LiveServer(build_app(server.engine, served_model_name="tiny", args=args), args=args)
    yield live
    live.stop()


def post(live, path, **kw):
    return httpx.post(live.url + path, timeout=30, **kw)


# ---- 1. chat templates from requests ---------------------------------------------------------
def test_request_chat_template_refused_unless_trusted(server):
    r = post(server, "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                                  "chat_template": "{{ 'ab' * 100000000 }}"})
    err = assert_error(r, 400, param="chat_template", code="chat_template_not_allowed")
    assert "--trust-request-chat-template" in err["message"]


def test_trusted_request_templates_are_bounded(hard):
    ok = post(hard, "/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 2, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %} w2"})
    assert ok.status_code == 200, ok.text
    bombs = ["{{ 'ab' * 100000000 }}", "{{ ['x'] * 10**9 }}", "{{ 7 ** 99999999 }}",
             "{% for i in range(10**9) %}x{% endfor %}",
             "{% set s = namespace(x='a') %}{% for i in range(60) %}{% set s.x = s.x + s.x %}{% endfor %}",
             "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}",  # time
             "{{ 'x' | center(2000000000) }}"]  # memory, caught by the worker's rlimit
    for bomb in bombs:
        t0 = time.monotonic()
        r = post(hard, "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "chat_template": bomb})
        assert_error(r, 400, param="chat_template")
        assert time.monotonic() - t0 < 10, bomb
    assert httpx.get(hard.url + "/health").status_code == 200
    assert_error(post(hard, "/v1/chat/completions", json={"messages": MSGS, "chat_template": "{% if %}"}), 400,
                 param="chat_template")


# ---- 2. the event loop never blocks; bodies and reads are bounded ----------------------------
def test_body_size_limit_413(hard):
    limit = hard.state.max_body_size
    big = "w1 " * (limit // 3 + 10)
    r = post(hard, "/v1/completions", json={"prompt": big, "max_tokens": 1})
    assert_error(r, 413, code="request_too_large")
    r = post(hard, "/tokenize", content=(b'{"prompt": "' + b"a" * (10 << 20) + b'"}'),
             headers={"content-type": "application/json"})
    assert_error(r, 413)


def test_overlong_text_refused_without_tokenising(hard):
    limit = hard.state.serving.input_processor.max_prompt_chars
    text = "w1 " * (limit // 3 + 1)
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": 1}), ("/tokenize", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        assert_error(post(hard, path, json=body), 400, code="context_length_exceeded")


def test_health_answers_while_a_long_prompt_is_tokenised(hard):
    """A long (allowed) text is tokenised on a worker thread with the GIL released."""
    text = "w1 " * (hard.state.serving.input_processor.max_prompt_chars // 3)

    async def run():
        async with httpx.AsyncClient(base_url=hard.url, timeout=30) as h:
            task = asyncio.ensure_future(h.post("/tokenize", json={"prompt": text}))
            probes = [await h.get("/health") for _ in range(3)]
            return await task, probes

    r, probes = asyncio.run(run())
    assert r.status_code == 200 and all(p.status_code == 200 for p in probes)


def test_idle_sockets_are_closed_and_stalled_bodies_get_408(hard):
    with socket.create_connection(("127.0.0.1", hard.port)) as s:  # never sends its headers
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
    with socket.create_connection(("127.0.0.1", hard.port)) as s:  # headers, then half a body
        s.settimeout(10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        reply = b""
        while b"}}" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"body_timeout" in reply


# ---- 3. n is capped and counted as sequences --------------------------------------------------
def test_n_cap(hard):
    err = assert_error(post(hard, "/v1/completions", json={"prompt": PROMPT, "n": 50000, "max_tokens": 1}), 400,
                       param="n")
    assert "128" in err["message"]
    assert post(hard, "/v1/completions", json={"prompt": PROMPT, "n": 4, "max_tokens": 1}).status_code == 200


def test_n_counts_against_the_waiting_limit(llama_ckpt):
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = make_engine(llama_ckpt, max_num_seqs=1, max_waiting_requests=2)
    live = LiveServer(build_app(engine, served_model_name="tiny", owns_engine=True))
    try:
        # more than an idle server can ever hold: the client's error (400), not an overload (issue 29)
        r = post(live, "/v1/completions", json={"prompt": PROMPT, "n": 4, "max_tokens": 1})
        assert_error(r, 400, param="n")
        assert "retry-after" not in r.headers
        # it fits an idle server but not now (3 sequences counted in flight): 429 with Retry-After
        engine._count("in-flight", 3)
        try:
            r = post(live, "/v1/completions", json={"prompt": PROMPT, "n": 1, "max_tokens": 1})
        finally:
            engine._release("in-flight")
        assert_error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "1"
        assert post(live, "/v1/completions", json={"prompt": PROMPT, "n": 3, "max_tokens": 1}).status_code == 200
        wait_idle(engine)
        assert not live.state.serving.live_streams  # refused requests' stream sets were closed, not kept (a leak)
    finally:
        live.stop()


# ---- 4. text that is not valid text ----------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["w1", "a\\udfffb"], "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "w1", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "w1", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", '{"tokens": [1], "model": "\\udc00"}', "model"),
])
def test_lone_surrogates_400(server, path, body, param):
    r = post(server, path, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param=param)
    assert "surrogate" in err["message"]


# ---- overload: deadlines ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hard_inprocess(llama_ckpt):
    """``hard``'s settings over an engine whose core runs in this process (its executor is slowed)."""
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    args = ServerArgs(trust_request_chat_template=True, chat_template_timeout=1.0, http_read_timeout=1.0,
                      metrics_prefix="vllm")
    live = LiveServer(build_app(make_engine(llama_ckpt, multiprocess=False), served_model_name="tiny",
                                owns_engine=True, args=args), args=args)
    yield live
    live.stop()


def test_request_timeout_aborts_and_frees_blocks(hard_inprocess):
    hard = hard_inprocess
    wait_idle(hard.engine)
    body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True, "timeout": 0.05}
    hold = hard.engine.engine.core.executor.execute

    def slow(so):  # at most ~40 steps/s, so 240 tokens cannot beat the deadline
        time.sleep(0.025)
        return hold(so)

    hard.engine.engine.core.executor.execute = slow
    try:
        assert_error(post(hard, "/v1/completions", json=body), 408, param="timeout", code="request_timeout")
        del body["timeout"]
        with httpx.stream("POST", hard.url + "/v1/completions", json={**body, "stream": True}, timeout=30,
                          headers={"x-request-timeout": "0.05"}) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
        assert_error(post(hard, "/v1/completions", json=body, headers={"x-request-timeout": "soon"}), 400,
                     param="timeout")
    finally:
        hard.engine.engine.core.executor.execute = hold
    wait_idle(hard.engine)


# ---- shutdown: drain, then end open requests with an error -----------------------------------
def test_drain_ends_open_streams_with_an_error_event(llama_ckpt):
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app
    from pagedllm.entrypoints.openai.serving import APIError

    engine = make_engine(llama_ckpt, multiprocess=False)  # its executor is slowed
    args = ServerArgs(shutdown_timeout=0.3)
    live = LiveServer(build_app(engine, served_model_name="tiny", owns_engine=True, args=args), args=args)
    hold = engine.engine.core.executor.execute
    engine.engine.core.executor.execute = lambda so: (time.sleep(0.02), hold(so))[1]
    try:
        body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            live.server.handle_exit(15, None)  # what SIGTERM does
            # uvicorn closes its listening socket and its idle connections: a new request is refused (no
            # connection, or one closed before an answer, whichever the race gives on a busy host) or gets 503
            try:
                assert_error(post(live, "/v1/completions", json={"prompt": PROMPT}), 503, code="shutting_down")
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                pass
            with pytest.raises(APIError, match="shutting down"):
                live.state.require()
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        wait_idle(engine)
    finally:
        live.stop()


# ---- metrics and request ids -----------------------------------------------------------------
def test_aborted_requests_counted_and_metrics_prefix(hard):
    wait_idle(hard.engine)
    body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", hard.url + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_lines())
    wait_idle(hard.engine)
    text = httpx.get(hard.url + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith("vllm:request_success_total{") and 'reason="abort"' in x]
    assert line and float(line[0].split()[-1]) >= 1, line
    assert "vllm:num_requests_running" in text and "pagedllm:" not in text


def test_request_id_echoed_or_generated(hard):
    r = post(hard, "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(hard.url + "/health")
    assert len(r.headers["x-request-id"]) == 32
    r = post(hard, "/v1/completions", json={"prompt": PROMPT, "tools": []}, headers={"x-request-id": "e1"})
    assert r.headers["x-request-id"] == "e1" and r.status_code == 400


# ---- errors a person can act on --------------------------------------------------------------
def test_errors_say_what_to_fix(hard):
    assert_error(post(hard, "/v1/completions", content=b"", headers={"content-type": "application/json"}), 400,
                 code="empty_body")
    assert_error(post(hard, "/v1/completions", content=b"prompt=hi",
                      headers={"content-type": "application/x-www-form-urlencoded"}), 415)
    r = httpx.get(hard.url + "/v1/completions")
    err = assert_error(r, 405, code="method_not_allowed")
    assert err["type"] == "invalid_request_error" and r.headers["allow"] == "POST"
    assert_error(httpx.get(hard.url + "/nope"), 404, code="not_found")
    assert_error(post(hard, "/v1/completions", json={"prompt": PROMPT, "max_tokens": True}), 400,
                 param="max_tokens", code="invalid_type")
    assert_error(post(hard, "/v1/completions", json={"prompt": PROMPT, "reasoning_effort": "high"}),
                 400, param="reasoning_effort", code="unsupported_field")
    assert_error(post(hard, "/v1/completions", json={"prompt": PROMPT, "response_format": {"type": "json"}}),
                 400, param="response_format", code="invalid_type")


def test_internal_errors_hide_details(hard):
    serving = hard.state.serving
    original = serving.check_model

    def boom(name):
        raise RuntimeError("secret internal state")

    serving.check_model = boom
    try:
        r = post(hard, "/v1/completions", json={"prompt": PROMPT}, headers={"x-request-id": "trace-me"})
    finally:
        serving.check_model = original
    err = assert_error(r, 500, code="internal_error")
    assert "secret" not in r.text and "trace-me" in err["message"]
