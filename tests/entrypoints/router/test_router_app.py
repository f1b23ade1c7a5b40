"""The router over fake backends on real sockets: prefix routing, least-loaded fallback,
unbuffered streaming, a dead replica taken out and retried, merged metrics, key passthrough."""
import json
import time

import httpx
import pytest

from fake_backends import FakeBackend, UvicornThread, free_port
from pagedllm.entrypoints.router.app import RouterArgs, build_router_app
from pagedllm.entrypoints.router.prompt_hashes import PromptHasher


CLIENT = httpx.Client(timeout=60)  # one client: a new one costs ~0.2 s on a busy machine

class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 512 for c in text]


@pytest.fixture
def backends():
    bs = [FakeBackend("a"), FakeBackend("b")]
    yield bs
    for b in bs:
        b.gate.set()
        b.stop()


def start_router(backends, **kw):
    args = RouterArgs(backends=tuple(b.url for b in backends), block_size=4, health_interval_s=0.05,
                      retry_min_s=0.05, retry_max_s=0.2, **kw)
    app = build_router_app(args, hasher=PromptHasher(CharTokenizer(), 4, {"base"}))
    server = UvicornThread(app, free_port())
    server.state = app.state.router
    wait_for(lambda: all(r.healthy for r in server.state.replicas.replicas))
    return server


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def router(backends):
    server = start_router(backends)
    yield server
    server.stop()


def complete(url, prompt, **kw):
    r = CLIENT.post(f"{url}/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 4, **kw},
                   timeout=10)
    return r


def test_prefix_groups_stick_to_one_replica(router, backends):
    groups = {g: f"{g}: the system prompt of group {g} " * 3 for g in range(4)}
    where = {g: set() for g in groups}
    for round_ in range(3):
        for g, prefix in groups.items():
            r = complete(router.url, prefix + f"question {round_}")
            assert r.status_code == 200
            where[g].add(r.headers["x-pagedllm-replica"])
            assert r.json()["backend"] == "ab"[int(r.headers["x-pagedllm-replica"])]
    assert all(len(w) == 1 for w in where.values())  # every group on one replica
    assert {next(iter(w)) for w in where.values()} == {"0", "1"}  # and the groups spread over both
    assert sum(r.prefix_routed for r in router.state.replicas.replicas) == 8  # rounds 2 and 3 hit


def test_stream_passes_through_unbuffered_and_load_decides_new_prefixes(router, backends):
    for b in backends:
        b.gate.clear()
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{router.url}/v1/completions",
                           json={"model": "base", "prompt": "held " * 8, "stream": True}) as first:
            assert first.headers["content-type"].startswith("text/event-stream")
            lines = first.iter_lines()
            # the first event arrives while the backend still holds the second one
            assert json.loads(next(line for line in lines if line)[6:])["i"] == 0
            busy = first.headers["x-pagedllm-replica"]
            r = complete(router.url, "a different prefix " * 3)
            assert r.headers["x-pagedllm-replica"] != busy  # the least loaded replica
            for b in backends:
                b.gate.set()
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[0][6:])["i"] == 1
    assert all(r.in_flight == 0 for r in router.state.replicas.replicas)


def test_dead_replica_is_taken_out_and_retried(router, backends):
    prompt = "shared prefix for the dead one " * 2
    owner = int(complete(router.url, prompt).headers["x-pagedllm-replica"])
    backends[owner].stop()
    for _ in range(3):  # the service keeps answering, from the other replica
        r = complete(router.url, prompt)
        assert r.status_code == 200 and int(r.headers["x-pagedllm-replica"]) == 1 - owner
    assert CLIENT.get(f"{router.url}/health").status_code == 200
    replica = router.state.replicas.replicas[owner]
    assert not replica.healthy and replica.failures >= 1
    metrics = CLIENT.get(f"{router.url}/metrics").text
    assert f'pagedllm_router:replica_up{{replica="{owner}",url="{backends[owner].url}"}} 0' in metrics
    backends[owner].start()  # back on its port: the backoff retry finds it
    wait_for(lambda: replica.healthy)
    assert CLIENT.get(f"{router.url}/metrics").text.count("replica_up{") == 2


def test_replica_dying_mid_stream_ends_with_an_error_event(router, backends):
    for b in backends:
        b.gate.clear()
        b.die_mid_stream = True
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{router.url}/v1/completions",
                           json={"model": "base", "prompt": "doomed " * 4, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line)
            for b in backends:
                b.gate.set()
            rest = [line for line in lines if line]
    error = json.loads(rest[0][6:])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    assert rest[-1] == "data: [DONE]"
    assert router.state.proxy_errors == 1


def test_no_healthy_replica_is_503_in_openai_shape(router, backends):
    for b in backends:
        b.stop()
    r = complete(router.url, "anything at all")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_replica" and r.json()["error"]["type"] == "server_error"
    wait_for(lambda: CLIENT.get(f"{router.url}/health").status_code == 503)


def test_metrics_merge_backends_with_a_replica_label(router, backends):
    complete(router.url, "one prompt here")
    complete(router.url, "another prompt, different")
    text = CLIENT.get(f"{router.url}/metrics").text
    assert text.count("# TYPE pagedllm:prompt_tokens counter") == 1  # one family, both replicas
    for i in (0, 1):
        assert f'pagedllm:prompt_tokens_total{{replica="{i}",model_name="base"}} 10.0' in text
        assert f'pagedllm:num_requests_running{{replica="{i}",model_name="base"}} 1.0' in text
        assert f'pagedllm_router:routed_requests_total{{replica="{i}",url="{backends[i].url}"}} 1' in text
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(text)}  # the whole text parses
    assert {"pagedllm_router:prefix_routed_requests", "pagedllm:num_requests_running"} <= names


def test_api_key_and_errors_pass_through(router, backends):
    r = CLIENT.post(f"{router.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-test"},
                   json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert "Bearer sk-test" in backends[0].auth + backends[1].auth
    r = complete(router.url, "x", model="unauthorized")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = CLIENT.get(f"{router.url}/v1/models").json()
    assert models["data"][0]["id"] == "base"


def test_oversized_body_is_413_and_models_are_not_counted_as_routed(backends):
    server = start_router(backends, max_request_body_size=200)
    try:
        r = complete(server.url, "w " * 200)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert not backends[0].received and not backends[1].received
        CLIENT.get(f"{server.url}/v1/models")
        assert sum(r.routed for r in server.state.replicas.replicas) == 0
    finally:
        server.stop()


def test_pagedllm_router_command(backends, llama_ckpt):
    """``pagedllm router`` as users start it: the model's tokenizer, text prompts routed by prefix."""
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--backends",
                             *(b.url for b in backends), "--model", llama_ckpt, "--port", str(port),
                             "--router-health-interval", "0.1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return CLIENT.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read()
                return False

        wait_for(up, timeout=60)
        prompt = " ".join(f"w{i}" for i in range(40))
        first = complete(url, prompt + " w1").headers["x-pagedllm-replica"]
        assert all(complete(url, prompt + f" w{q}").headers["x-pagedllm-replica"] == first for q in range(2, 5))
        assert "pagedllm_router:prefix_routed_requests_total" in CLIENT.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
