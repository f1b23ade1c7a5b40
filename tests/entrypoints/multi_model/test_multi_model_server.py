"""``pagedllm serve`` with several models, end to end over real tiny models: a pinned generator, a
second generator and a BERT embedder under a budget that holds the pinned one and one other, plus a
corrupt checkpoint. Clients interleave across all of them: every answer is right (greedy output
identical to the model served alone), the budget holds, a load failure is that model's error only,
and a stop ends every model server."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pooling_checkpoints import make_pooling_checkpoint
from processes import children, wait_gone

pytestmark = pytest.mark.slow
MiB = 1 << 20
SHAKESPEARE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "models", "tiny-shakespeare")
CLIENT = httpx.Client(timeout=600)  # a request may wait for loads on a busy host


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], deadline_s: float = 240):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256", "--log-level", "warning", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if CLIENT.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the multi-model server did not start: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)


def _stop(proc) -> None:
    kids = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_gone(kids, 30) == [], "a model server outlived the multi-model server"


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start!r} in /metrics")


@pytest.fixture(scope="module")
def models(llama_ckpt, ckpt_dir):
    bert = make_pooling_checkpoint(str(ckpt_dir / "mm_bert"), "bert_mean")
    broken = ckpt_dir / "mm_broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text("{this is not json")
    cfg = ckpt_dir / "mm_models.yaml"
    cfg.write_text(f"""models:
  - model: {os.path.abspath(SHAKESPEARE)}
    name: bard
    pin: true
  - model: {llama_ckpt}
    name: llama
  - model: {bert}
    name: bert
    options: {{runner: pooling, max_model_len: 128}}
  - model: {broken}
    name: broken
""")
    budget = 1400 * MiB  # each model counts its 300 MiB KV cache: the pinned one and one other fit, not three
    proc, url = _start(["--models-config", str(cfg), "--models-memory", str(budget), "--kv-cache-memory", "300MiB"])
    yield url, budget, llama_ckpt, bert
    _stop(proc)


def _ask(url: str, model: str, prompt: str):
    if model == "bert":
        r = CLIENT.post(f"{url}/v1/embeddings", json={"model": model, "input": prompt})
        return r.status_code, (r.json()["data"][0]["embedding"] if r.status_code == 200 else r.text)
    r = CLIENT.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                    "temperature": 0})
    return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)


def test_interleaved_clients_across_more_models_than_fit(models):
    url, budget, llama_ckpt, bert = models
    rng = random.Random(3)
    prompts = [" ".join(f"w{rng.randrange(500)}" for _ in range(5)) for _ in range(3)]
    plan = [[(rng.choice(["bard", "llama", "bert"]), rng.choice(prompts)) for _ in range(6)] for _ in range(8)]
    answers: dict = {}
    failures: list = []

    def client(jobs):
        for model, prompt in jobs:
            status, out = _ask(url, model, prompt)
            if status != 200:
                failures.append((model, status, out))
            else:
                answers.setdefault((model, prompt), []).append(out)

    threads = [threading.Thread(target=client, args=(jobs,)) for jobs in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures[:3]
    assert sum(len(v) for v in answers.values()) == 48
    for (model, prompt), outs in answers.items():  # the same answer before and after every reload
        if model == "bert":
            assert all(max(abs(a - b) for a, b in zip(o, outs[0])) < 1e-5 for o in outs), model
        else:
            assert all(o == outs[0] for o in outs), (model, prompt, outs)

    from pagedllm import LLM, SamplingParams

    alone = LLM(model=llama_ckpt, dtype="float32", max_model_len=256, kv_cache_memory=16 * MiB)
    for (model, prompt), outs in answers.items():
        if model == "llama":  # identical to the model served on its own
            assert alone.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text == outs[0]
    text = CLIENT.get(f"{url}/metrics").text
    assert _metric(text, "pagedllm:models_memory_peak_bytes") <= budget * 1.1
    assert _metric(text, 'pagedllm:model_unloads_total{model_name="bard"') == 0  # pinned: never unloaded
    assert _metric(text, 'pagedllm:model_loaded{model_name="bard"}') == 1
    unloads = sum(_metric(text, f'pagedllm:model_unloads_total{{model_name="{m}",reason="memory"}}')
                  for m in ("llama", "bert"))
    assert unloads >= 1, "three models fit a budget meant for two"
    assert 'model_name="bard"' in text and "pagedllm:num_requests_running" in text  # the model servers' own


def test_a_broken_model_is_its_own_error_and_the_rest_keep_serving(models):
    url, *_ = models
    r = CLIENT.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "model_load_failed" and "`broken` failed to load" in err["message"]
    assert _ask(url, "bard", "ROMEO:")[0] == 200
    cards = {c["id"]: c for c in CLIENT.get(f"{url}/v1/models").json()["data"]}
    assert set(cards) == {"bard", "llama", "bert", "broken"}
    assert cards["bard"]["loaded"] and cards["bard"]["pinned"] and cards["bard"]["max_model_len"] == 256
    assert cards["broken"]["state"] == "failed" and not cards["broken"]["loaded"]


def test_routing_errors_and_a_stream_through_the_front(models):
    url, *_ = models
    r = CLIENT.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "bard, llama, bert, broken" in r.json()["error"]["message"]
    r = CLIENT.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and "'model' field is required" in r.json()["error"]["message"]
    r = CLIENT.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert r.status_code == 400
    with CLIENT.stream("POST", f"{url}/v1/completions", json={"model": "bard", "prompt": "ROMEO:", "max_tokens": 6,
                                                               "temperature": 0, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["x-pagedllm-model"] == "bard"
        events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    r = CLIENT.post(f"{url}/tokenize", json={"model": "bard", "prompt": "ROMEO:"})
    assert r.status_code == 200 and r.json()["count"] >= 1


def test_two_models_by_flag_idle_unload_and_the_openai_client(llama_ckpt):
    openai = pytest.importorskip("openai")
    proc, url = _start(["--model", os.path.abspath(SHAKESPEARE), "--model", llama_ckpt, "--served-model-name", "bard",
                        "llama", "--pin-model", "bard", "--model-idle-timeout", "1", "--kv-cache-memory", "16MiB",
                        "--enable-dashboard"])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        assert {m.id for m in client.models.list().data} == {"bard", "llama"}
        out = client.completions.create(model="llama", prompt="w1 w2", max_tokens=4, temperature=0)
        assert out.model == "llama" and out.choices[0].text
        page = CLIENT.get(f"{url}/dashboard")  # the models page, and each loaded model's own live page
        assert page.status_code == 200 and "models.js" in page.text and page.headers["x-frame-options"] == "DENY"
        snap = CLIENT.get(f"{url}/dashboard/api/models").json()
        assert {m["name"]: m["pinned"] for m in snap["models"]} == {"bard": True, "llama": False}
        assert CLIENT.get(f"{url}/models/bard/dashboard/api/state").json()["status"] == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # llama is unloaded once idle for a second; bard is pinned
            cards = {c["id"]: c for c in CLIENT.get(f"{url}/v1/models").json()["data"]}
            if cards["llama"]["state"] == "unloaded":
                break
            time.sleep(0.2)
        assert cards["llama"]["state"] == "unloaded" and cards["bard"]["loaded"]
        text = CLIENT.get(f"{url}/metrics").text
        assert _metric(text, 'pagedllm:model_unloads_total{model_name="llama",reason="idle"}') == 1
        t0 = time.monotonic()
        again = client.completions.create(model="llama", prompt="w1 w2", max_tokens=4, temperature=0)
        assert again.choices[0].text == out.choices[0].text  # loaded again on its next request
        load_s = _metric(CLIENT.get(f"{url}/metrics").text, 'pagedllm:model_load_seconds_sum{model_name="llama"}')
        assert time.monotonic() - t0 < load_s + 30  # the first request after an unload waits for the load only
    finally:
        _stop(proc)
