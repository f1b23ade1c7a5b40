"""Issue 29, the HTTP side: every route reads its body under the size limit and read timeout
(the LoRA routes too, with runtime LoRA updating off), the API key is checked before a body is
read, a 500 keeps the keep-alive connection, input nested too deeply is a 400, HEAD /health
answers like GET. Apps over the shared engine (no second model load)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import LiveServer
from test_openai_errors import assert_error

LIMIT = 64 << 10
KEY = "k29"
PROMPT = "w11 w12 w13"


def _live(server, **kw):
    from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app

    args = ServerArgs(http_read_timeout=1.0, max_request_body_size=LIMIT, **kw)
    return LiveServer(build_app(server.engine, served_model_name="tiny", api_key=kw.get("api_key"), args=args),
                      args=args)


@pytest.fixture(scope="module")
def open_server(server):
    """No API key, runtime LoRA updating off, a 64 KiB body limit and a 1 s read timeout."""
    live = _live(server)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def keyed(server):
    live = _live(server, api_key=KEY)
    yield live
    live.stop()


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh socket and read until the server closes it or ``timeout``."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(timeout)
        s.sendall(data)
        reply = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except socket.timeout:
            pass
        return reply


@pytest.mark.parametrize("route", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_lora_routes_bound_the_body_before_parsing(open_server, route):
    big = {"lora_name": "x" * (LIMIT + 10), "lora_path": "/nowhere"}
    err = assert_error(httpx.post(open_server.url + route, json=big, timeout=30), 413, code="request_too_large")
    assert str(LIMIT) in err["message"]
    # a streamed (chunked) body without a Content-Length is cut at the limit as well
    chunks = (b"x" * 4096 for _ in range(LIMIT // 4096 + 4))
    assert_error(httpx.post(open_server.url + route, content=chunks, headers={"content-type": "application/json"},
                            timeout=30), 413)
    assert_error(httpx.post(open_server.url + route, content=b"lora_name=a",
                            headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30), 415)
    # a small body is parsed and refused for what it is: runtime updating is off
    assert_error(httpx.post(open_server.url + route, json={"lora_name": "a", "lora_path": "/p"}, timeout=30), 404)


def test_lora_route_trickled_body_is_cut_by_the_read_timeout(open_server):
    t0 = time.monotonic()
    reply = raw_exchange(open_server.port, b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"lora_name\":", timeout=15)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"body_timeout" in reply and time.monotonic() - t0 < 10


def test_a_body_far_over_the_limit_gets_its_413_not_a_reset(open_server):
    """The server reads and drops a refused body before it answers and closes: a client still
    sending megabytes (as httpx does) reads the 413, not a connection reset."""
    for content in (b"x" * (6 << 20) + b"y", (b"x" * 65536 for _ in range(100))):  # declared, chunked
        r = httpx.post(open_server.url + "/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
        assert_error(r, 413, code="request_too_large")
    assert httpx.get(open_server.url + "/health").status_code == 200


def test_every_route_bounds_its_body(open_server):
    """A body on a route that takes none (GET /v1/models, an unknown path) is bounded too."""
    for method, path in (("GET", "/v1/models"), ("POST", "/nope"), ("GET", "/health")):
        r = httpx.request(method, open_server.url + path, content=b"x" * (LIMIT + 1), timeout=30)
        assert_error(r, 413, code="request_too_large")
    r = httpx.request("GET", open_server.url + "/v1/models", content=b"{}", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_api_key_checked_before_the_body_is_read(keyed):
    """Without the key the answer is 401 at once, though the 1 GB body it announces never comes."""
    t0 = time.monotonic()
    reply = raw_exchange(keyed.port, b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{", timeout=15)
    assert reply.startswith(b"HTTP/1.1 401"), reply
    assert b"invalid_api_key" in reply and time.monotonic() - t0 < 0.9  # before the 1 s read timeout
    assert_error(httpx.post(keyed.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}), 401)
    ok = httpx.post(keyed.url + "/v1/unload_lora_adapter", json={"lora_name": "a"},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert_error(ok, 404)  # authorised, then refused: runtime updating is off
    big = httpx.post(keyed.url + "/v1/load_lora_adapter", content=b"x" * (LIMIT + 1),
                     headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert_error(big, 413)
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_head_health_answers_like_get(open_server):
    for path in ("/health", "/ping"):
        get, head = httpx.get(open_server.url + path), httpx.head(open_server.url + path)
        assert head.status_code == get.status_code == 200 and head.content == b""


def test_a_500_keeps_the_connection(open_server):
    serving = open_server.state.serving
    original = serving.check_model

    def boom(name):
        raise RuntimeError("secret internal state")

    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    serving.check_model = boom
    try:
        with socket.create_connection(("127.0.0.1", open_server.port)) as s:
            s.settimeout(20)
            first = _read_response(s.makefile("rb"), s, request)
            serving.check_model = original
            second = _read_response(s.makefile("rb"), s, request)
    finally:
        serving.check_model = original
    assert first[0] == 500 and b"internal_error" in first[1] and b"secret" not in first[1]
    assert second[0] == 200 and json.loads(second[1])["choices"]


def _read_response(f, s, request: bytes):
    s.sendall(request)
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, f.read(length)


DEEP = "[" * 20000 + "]" * 20000


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "guided_json": DEEP}),
    ("/v1/chat/completions", {"max_tokens": 1, "messages": [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "w2"}]}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "guided_json": '{"a":' * 6000 + "1" + "}" * 6000}),
])
def test_deep_nesting_inside_strings_is_400(open_server, path, body):
    r = httpx.post(open_server.url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["code"]
    assert httpx.get(open_server.url + "/health").status_code == 200


def test_deep_nesting_in_the_body_itself_is_400(open_server):
    schema = '{"type":"object","properties":{"a":' * 3000 + "{}" + "}}" * 3000
    body = '{"prompt":"w1","max_tokens":1,"response_format":{"type":"json_schema","json_schema":{"name":"x",' \
           '"schema":' + schema + "}}}"
    r = httpx.post(open_server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text


# ---- large bodies are parsed off the event loop ------------------------------------------------
PAD = b" " * (80 << 10)  # leading whitespace: valid JSON, and over body_parsing.INLINE_BODY_BYTES


def test_health_answers_while_a_large_body_is_parsed(server, monkeypatch):
    """Issue 29: a large body's JSON decoding and validation run on the parse pool, so /health
    and other requests are answered while it is parsed (here: held in the parser until they were)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pagedllm.entrypoints.openai import body_parsing

    started, release = threading.Event(), threading.Event()
    real = body_parsing.decode_and_validate

    def held(body, field):
        started.set()
        release.wait(60)
        return real(body, field)

    monkeypatch.setattr(body_parsing, "decode_and_validate", held)
    big = PAD + json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).encode()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + "/v1/completions", content=big,
                              headers={"content-type": "application/json"}, timeout=120)
        try:
            assert started.wait(30), "the large body never reached the parse pool"
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            small = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
                               timeout=60)
            assert small.status_code == 200 and not pending.done(), small.text
        finally:
            release.set()
        r = pending.result(120)
    assert r.status_code == 200 and r.json()["choices"], r.text


@pytest.mark.parametrize("body", [b'{"prompt": "w1", "max_tokens": ', b'{"prompt": "w1", "frobnicate": 1}',
                                  b'{"prompt": "w1", "max_tokens": "ten"}', b'{"prompt": "\xff\xfe"}'])
def test_a_large_body_gets_the_error_a_small_one_gets(server, body):
    def answer(content):
        r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        return r.status_code, r.json()["error"]

    small, large = answer(body), answer(PAD + body)
    assert 400 <= small[0] < 500 and large == small, (small, large)
