"""``pagedllm serve --data-parallel-size 2`` end to end: two real tiny replicas (child servers)
behind the router. A shared-prefix workload sends each prefix group to one replica, so the
engines' prefix caches hit; killing one replica leaves the service answering."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from fake_backends import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs 2 CPU cores (one per replica)")


CLIENT = httpx.Client(timeout=60)  # one client: a new one costs ~0.2 s on a busy machine

def children(pid: int) -> dict[int, int]:
    """{port: pid} of the replica servers the launcher started."""
    out = {}
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/cmdline", "rb") as c:
                argv = c.read().split(b"\0")
            out[int(argv[argv.index(b"--port") + 1])] = int(child)
    return out


def metric(text: str, name: str, replica: int) -> float:
    m = re.search(rf'^{re.escape(name)}{{replica="{replica}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _start_dp(llama_ckpt, *extra):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", llama_ckpt, "--data-parallel-size", "2",
         "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "256",
         "--router-health-interval", "0.2", "--log-level", "warning", "--no-cpu-kernels", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            text = CLIENT.get(f"{url}/metrics", timeout=2).text
            if len(re.findall(r"^pagedllm_router:replica_up\{.*\} 1$", text, re.M)) == 2:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the data-parallel server did not start: {proc.stderr.read()[-3000:]}")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def dp_server(llama_ckpt):
    proc, url = _start_dp(llama_ckpt)
    yield proc, url
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_groups_share_one_replica_cache_then_survive_a_dead_replica(dp_server):
    proc, url = dp_server
    assert CLIENT.get(f"{url}/v1/models").json()["data"]
    rng = random.Random(5)  # the test tokenizer knows the words w0..w508
    groups = [" ".join(f"w{rng.randrange(509)}" for _ in range(48)) for _ in range(4)]
    where = {g: set() for g in range(4)}
    with httpx.Client(timeout=60) as client:
        for q in range(3):
            for g, prefix in enumerate(groups):
                r = client.post(f"{url}/v1/completions", json={"prompt": prefix + f" w{q} w{q + 7}", "max_tokens": 2,
                                                               "temperature": 0})
                assert r.status_code == 200, r.text
                where[g].add(r.headers["x-pagedllm-replica"])
        chat = client.post(f"{url}/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": groups[0]}], "max_tokens": 2})
        assert chat.status_code == 200
    assert all(len(w) == 1 for w in where.values()), where
    assert {next(iter(w)) for w in where.values()} == {"0", "1"}
    text = CLIENT.get(f"{url}/metrics").text
    hits = sum(metric(text, "pagedllm:prefix_cache_hits_total", i) for i in (0, 1))
    queries = sum(metric(text, "pagedllm:prefix_cache_queries_total", i) for i in (0, 1))
    assert queries > 0 and hits / queries > 0.5  # rounds 2 and 3 find their group's prefix cached
    assert sum(metric(text, "pagedllm_router:prefix_routed_requests_total", i) for i in (0, 1)) >= 8

    # kill replica 0's server: every request is still answered (by replica 1)
    kids = children(proc.pid)
    assert len(kids) == 2
    port0 = int(re.search(r'replica="0",url="http://127.0.0.1:(\d+)"', text).group(1))
    os.kill(kids[port0], signal.SIGKILL)
    with httpx.Client(timeout=60) as client:
        for g, prefix in enumerate(groups):
            r = client.post(f"{url}/v1/completions", json={"prompt": prefix + " w1 w2 w3", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedllm-replica"] == "1"
    assert CLIENT.get(f"{url}/health").status_code == 200


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_sigterm_drains_streams_through_the_router(llama_ckpt):
    """SIGTERM with --shutdown-timeout 1 and 8 open streams: every stream ends with [DONE] (an
    error event first for one cut short), the launcher exits 0 and its replicas are gone."""
    import asyncio
    import json as json_

    proc, url = _start_dp(llama_ckpt, "--shutdown-timeout", "1")
    kids = list(children(proc.pid).values())
    body = {"prompt": "w1 w2 w3", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}

    async def one(h, started):
        async with h.stream("POST", "/v1/completions", json=body) as r:
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        started.release()
            return lines

    async def run():
        started = asyncio.Semaphore(0)
        async with httpx.AsyncClient(base_url=url, timeout=120) as h:
            tasks = [asyncio.ensure_future(one(h, started)) for _ in range(8)]
            for _ in tasks:
                await started.acquire()
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    try:
        streams = asyncio.run(run())
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json_.loads(lines[-2][6:])
        if "error" in last:
            assert last["error"]["code"] == "shutting_down"
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 30
    while not all(_gone(k) for k in kids):
        assert time.monotonic() < deadline, "replicas outlived the launcher"
        time.sleep(0.2)


@pytest.mark.slow
def test_replicas_die_with_a_killed_launcher(llama_ckpt):
    proc, url = _start_dp(llama_ckpt, "--shutdown-timeout", "1")
    kids = children(proc.pid)
    proc.kill()  # SIGKILL: no handler runs in the launcher
    proc.wait(10)
    deadline = time.monotonic() + 60
    while not all(_gone(pid) for pid in kids.values()):
        assert time.monotonic() < deadline, "replicas outlived a SIGKILLed launcher"
        time.sleep(0.2)
    for port in kids:
        with pytest.raises(httpx.HTTPError):
            CLIENT.get(f"http://127.0.0.1:{port}/health", timeout=2)
