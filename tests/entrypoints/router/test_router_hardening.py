"""Issue 29: the router in front of two real ``pagedllm serve`` apps (over the shared tiny engine)
checks its API key before reading or forwarding a body, bounds bodies (size and read time) on
every route, /tokenize included, and never takes a replica out for a client's bad request --
a body a replica refuses with 413 -- only for a replica that is itself down."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest

from fake_backends import free_port
from test_http_bounds import raw_exchange  # tests/entrypoints is on the path (its conftest)

KEY = "rk29"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_LIMIT = 64 << 10
ROUTER_LIMIT = 4 << 20


class Replica:
    """A real OpenAI app over the shared engine, served with ``pagedllm serve``'s uvicorn settings."""

    def __init__(self, engine) -> None:
        from pagedllm.entrypoints.openai.api_server import ServerArgs, build_app, make_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ServerArgs(api_key=KEY, max_request_body_size=REPLICA_LIMIT, http_read_timeout=2.0, port=self.port,
                          log_level="warning")
        self.server = make_server(build_app(engine, served_model_name="tiny", api_key=KEY, args=args), args)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _until(lambda: self.server.started)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def routed(server):
    import uvicorn

    from pagedllm.entrypoints.http_guard import http_protocol
    from pagedllm.entrypoints.router.app import RouterArgs, build_router_app

    replicas = [Replica(server.engine), Replica(server.engine)]
    args = RouterArgs(backends=tuple(r.url for r in replicas), policy="least_loaded", health_interval_s=0.2,
                      retry_min_s=0.2, retry_max_s=1.0, api_key=KEY, max_request_body_size=ROUTER_LIMIT,
                      http_read_timeout=1.0)
    app = build_router_app(args)
    port = free_port()
    router = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=5, http=http_protocol("auto", 1.0)))
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    state = app.state.router
    _until(lambda: router.started and all(r.healthy for r in state.replicas.replicas))
    yield dataclasses.make_dataclass("Routed", ["url", "port", "state", "replicas"])(
        f"http://127.0.0.1:{port}", port, state, replicas)
    router.should_exit = True
    thread.join(30)
    for r in replicas:
        r.stop()


def _all_up(routed) -> bool:
    return all(r.healthy for r in routed.state.replicas.replicas)


def test_key_checked_before_the_body_is_read_or_forwarded(routed):
    routed_before = sum(r.routed for r in routed.state.replicas.replicas)
    t0 = time.monotonic()  # a 5 MB body announced and never sent: the answer does not wait for it
    reply = raw_exchange(routed.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 5000000\r\n\r\n{")
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply, reply
    assert time.monotonic() - t0 < 0.9  # before the 1 s read timeout
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/v1/models"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", routed.url + path, json={"prompt": "w1"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert sum(r.routed for r in routed.state.replicas.replicas) == routed_before  # nothing forwarded
    assert httpx.get(routed.url + "/health").status_code == 200  # open paths stay open
    assert httpx.head(routed.url + "/health").status_code == 200


def test_bodies_bounded_on_every_route(routed):
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/v1/chat/completions"):
        r = httpx.post(routed.url + path, content=b"x" * (ROUTER_LIMIT + 1), headers={**AUTH, "content-type":
                                                                                         "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", (path, r.text)
    chunks = (b"x" * 65536 for _ in range(ROUTER_LIMIT // 65536 + 2))  # chunked: no Content-Length
    r = httpx.post(routed.url + "/tokenize", content=chunks, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    reply = raw_exchange(routed.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"pro",
                 timeout=15)
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply, reply
    assert _all_up(routed)


def test_a_body_the_replicas_refuse_takes_no_replica_out(routed):
    """Bodies over the replicas' limit (under the router's): each replica reads the body it
    refuses and answers 413; the router relays that unchanged (no retry, no 502), both replicas
    stay in, and authorised requests sent meanwhile are all answered."""
    big = {"prompt": "w1 " * (1 << 20), "max_tokens": 1}  # 3 MiB: over the replicas limit, under the router's

    async def run():
        async with httpx.AsyncClient(base_url=routed.url, headers=AUTH, timeout=60) as h:
            bad = [h.post("/v1/completions", json=big) for _ in range(8)]
            good = [h.post("/v1/completions", json={"prompt": "w11 w12", "max_tokens": 1}) for _ in range(8)]
            return await asyncio.gather(*bad), await asyncio.gather(*good)

    bad, good = asyncio.run(run())
    assert all(r.status_code == 413 and r.json()["error"]["code"] == "request_too_large" for r in bad), \
        [(r.status_code, r.text[:200]) for r in bad]
    assert all(r.status_code == 200 for r in good), [(r.status_code, r.text[:200]) for r in good]
    assert _all_up(routed) and all(r.failures == 0 for r in routed.state.replicas.replicas)
    tok = httpx.post(routed.url + "/tokenize", json={"prompt": "w1 w2"}, headers=AUTH)
    assert tok.status_code == 200 and tok.json()["count"] >= 2
    nested = '{"prompt":' + "[" * 20000 + "]" * 20000 + "}"  # the router's own parse must not 500
    r = httpx.post(routed.url + "/v1/completions", content=nested, headers={**AUTH, "content-type":
                                                                           "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert _all_up(routed)


def test_a_replica_really_down_is_still_taken_out(routed):
    """(Last in the module: replica 0 stays stopped.)"""
    routed.replicas[0].stop()
    for _ in range(3):
        r = httpx.post(routed.url + "/v1/completions", json={"prompt": "w11 w12", "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 200 and r.headers["x-pagedllm-replica"] == "1"
    assert not routed.state.replicas.replicas[0].healthy and routed.state.replicas.replicas[1].healthy


def test_client_gone_before_the_answer_aborts_the_replicas_request(llama_ckpt):
    """A non-streaming request through the router whose client leaves: the router drops the
    upstream connection, the replica aborts the request, the engine goes idle (a 240-token
    generation at ~40 steps/s would otherwise run for 6 s), nothing is counted in flight."""
    import uvicorn
    from conftest import make_engine, wait_idle

    from pagedllm.entrypoints.http_guard import http_protocol
    from pagedllm.entrypoints.router.app import RouterArgs, build_router_app

    engine = make_engine(llama_ckpt, multiprocess=False)
    hold = engine.engine.core.executor.execute
    engine.engine.core.executor.execute = lambda so: (time.sleep(0.025), hold(so))[1]
    replica = Replica(engine)
    app = build_router_app(RouterArgs(backends=(replica.url,), policy="least_loaded", health_interval_s=0.2,
                                      retry_min_s=0.2, api_key=KEY))
    port = free_port()
    router = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=http_protocol("auto", 5.0)))
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    state = app.state.router
    try:
        _until(lambda: router.started and state.replicas.replicas[0].healthy)
        body = {"prompt": "w11 w12", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=AUTH, timeout=1.0)
        t0 = time.monotonic()
        wait_idle(engine, timeout=5.0)
        assert time.monotonic() - t0 < 5.0
        _until(lambda: state.replicas.replicas[0].in_flight == 0, timeout=5)
    finally:
        router.should_exit = True
        thread.join(30)
        replica.stop()
        engine.shutdown()
