"""What one pooling request may cost: max_pooling_inputs, max_pooling_tokens and
max_pooling_output_values refused with a 400 naming the request field and the limit, on every
pooling route; a large request within the default bounds is tokenized, run and its JSON built off
the event loop, /health answering meanwhile."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import LiveServer, wait_ready
from pooling_checkpoints import make_pooling_checkpoint

from pagedllm.config import EngineConfig

LIMITS = dict(max_pooling_inputs=4, max_pooling_tokens=40, max_pooling_output_values=1000)


def _serve(path: str, **kw) -> LiveServer:
    from pagedllm.entrypoints.openai.api_server import build_app

    return wait_ready(LiveServer(build_app(EngineConfig(model=path, dtype="float32", runner="pooling", **kw))),
                      "pooling")


@pytest.fixture(scope="module")
def bounded(ckpt_dir):
    """An embedding model (CLS pooling) served with small per-request bounds."""
    live = _serve(make_pooling_checkpoint(str(ckpt_dir / "pool_xlmr_cls"), "xlmr_cls"), **LIMITS)
    yield live
    live.stop()


def _refused(live: LiveServer, route: str, body: dict) -> dict:
    r = httpx.post(live.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _ok(live: LiveServer, route: str, body: dict) -> dict:
    r = httpx.post(live.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_config_bounds_and_serve_flags(ckpt_dir):
    from pagedllm.entrypoints.cli import _build_parser, engine_config_from_args

    path = make_pooling_checkpoint(str(ckpt_dir / "pool_xlmr_cls"), "xlmr_cls")
    for name in ("max_pooling_inputs", "max_pooling_tokens", "max_pooling_output_values"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(model=path, **{name: 0})
    default = EngineConfig(model=path)
    assert (default.max_pooling_inputs, default.max_pooling_tokens, default.max_pooling_output_values) == \
        (2048, 1 << 20, None)
    args = _build_parser().parse_args(["serve", path, "--max-pooling-inputs", "16", "--max-pooling-tokens",
                                       "5000", "--max-pooling-output-values", "70000"])
    args.model = args.model_pos
    cfg = engine_config_from_args(args)
    assert (cfg.max_pooling_inputs, cfg.max_pooling_tokens, cfg.max_pooling_output_values) == (16, 5000, 70000)


def test_too_many_inputs(bounded):
    e = _refused(bounded, "/v1/embeddings", {"input": [[5, 6]] * 5})  # token-id inputs
    assert e["param"] == "input" and "max_pooling_inputs" in e["message"] and "4 " in e["message"]
    e = _refused(bounded, "/v1/rerank", {"query": "w1", "documents": ["w2"] * 5})
    assert e["param"] == "documents" and "max_pooling_inputs" in e["message"]
    e = _refused(bounded, "/score", {"text_1": "w1", "text_2": ["w2"] * 6})
    assert e["param"] == "text_2" and "max_pooling_inputs" in e["message"]
    e = _refused(bounded, "/score", {"queries": "w1", "documents": ["w2"] * 6})  # vLLM 0.32's spelling
    assert e["param"] == "documents" and "max_pooling_inputs" in e["message"]
    assert len(_ok(bounded, "/v1/embeddings", {"input": [[5, 6]] * 4})["data"]) == 4


def test_too_many_tokens(bounded):
    text = " ".join(["w7"] * 13)  # 15 tokens with [CLS] and [SEP]
    e = _refused(bounded, "/pooling", {"input": [text] * 3})
    assert e["param"] == "input" and "max_pooling_tokens" in e["message"] and "40" in e["message"]
    assert _ok(bounded, "/pooling", {"input": [text] * 2})["usage"]["prompt_tokens"] == 30
    long = " ".join(["w9"] * 18)  # 20 tokens: with the query's, past 40
    e = _refused(bounded, "/rerank", {"query": "w1 w2", "documents": [long, long]})
    assert e["param"] == "documents" and "max_pooling_tokens" in e["message"]
    e = _refused(bounded, "/score", {"text_1": ["w1", "w2"], "text_2": [long, long]})
    assert e["param"] == "text_2" and "max_pooling_tokens" in e["message"]
    e = _refused(bounded, "/score", {"queries": ["w1", "w2"], "documents": [long, long]})
    assert e["param"] == "documents" and "max_pooling_tokens" in e["message"]


def test_reply_too_large(bounded):
    """token_embed's reply is a vector per token: 2 x 10 tokens x 64 numbers is past 1000."""
    inputs = [[5 + i for i in range(10)], [50 + i for i in range(10)]]
    e = _refused(bounded, "/pooling", {"input": inputs, "task": "token_embed"})
    assert e["param"] == "input" and e["code"] == "response_too_large"
    assert "max_pooling_output_values" in e["message"] and "1000" in e["message"] and "1280" in e["message"]
    one = _ok(bounded, "/pooling", {"input": inputs[0], "task": "token_embed"})
    assert np.array(one["data"][0]["data"]).shape == (10, 64)
    assert len(_ok(bounded, "/pooling", {"input": inputs, "task": "embed"})["data"]) == 2


def test_classify_bounds_and_off_the_event_loop(ckpt_dir, monkeypatch):
    """/classify under the same per-request bounds (max_pooling_inputs, max_pooling_tokens), its
    tokenizing and reply on a worker thread."""
    from pagedllm.entrypoints.openai import serving_pooling

    live = _serve(make_pooling_checkpoint(str(ckpt_dir / "pool_bert_classify"), "bert_classify"), **LIMITS)
    try:
        e = _refused(live, "/classify", {"input": ["w1"] * 5})
        assert e["param"] == "input" and "max_pooling_inputs" in e["message"]
        text = " ".join(["w7"] * 13)  # 15 tokens
        e = _refused(live, "/v1/classify", {"input": [text] * 3})
        assert e["param"] == "input" and "max_pooling_tokens" in e["message"]
        engine, where = live.state.pooling.engine, []
        real_tokenize, real_reply = engine.tokenize, serving_pooling.PoolingServing._classify_reply
        monkeypatch.setattr(engine, "tokenize", lambda *a: where.append(_on_event_loop()) or real_tokenize(*a))
        monkeypatch.setattr(serving_pooling.PoolingServing, "_classify_reply",
                            lambda *a: where.append(_on_event_loop()) or real_reply(*a))
        body = _ok(live, "/classify", {"input": [text] * 2})
        assert len(body["data"]) == 2 and body["usage"]["prompt_tokens"] == 30
        assert len(where) == 3 and not any(where)
    finally:
        live.stop()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_large_reply_built_off_the_event_loop(ckpt_dir, monkeypatch):
    """600 inputs of 102 tokens, token_embed (~3.9M numbers, ~75 MB of JSON; within the default
    bounds): tokenized and encoded on worker threads, /health answering throughout."""
    from pagedllm.entrypoints.openai import serving_pooling

    live = _serve(make_pooling_checkpoint(str(ckpt_dir / "pool_bert_mean"), "bert_mean"))
    try:
        engine, where = live.state.pooling.engine, []
        real_tokenize, real_reply = engine.tokenize, serving_pooling._list_reply
        monkeypatch.setattr(engine, "tokenize", lambda *a: where.append(_on_event_loop()) or real_tokenize(*a))
        monkeypatch.setattr(serving_pooling, "_list_reply",
                            lambda *a: where.append(_on_event_loop()) or real_reply(*a))
        inputs = [" ".join(f"w{(i + j) % 190 + 5}" for i in range(100)) for j in range(600)]
        result: dict = {}

        def post() -> None:
            result["r"] = httpx.post(live.url + "/pooling", json={"input": inputs, "task": "token_embed"}, timeout=600)

        client = threading.Thread(target=post)
        client.start()
        health = []
        while True:  # at least one /health while the request runs (or right after it)
            health.append(httpx.get(live.url + "/health", timeout=120).status_code)
            if not client.is_alive():
                break
            time.sleep(0.05)
        client.join()
        assert health and set(health) == {200}
        r = result["r"]
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        assert [d["index"] for d in body["data"]] == list(range(600)) and body["usage"]["prompt_tokens"] == 600 * 102
        assert np.array(body["data"][7]["data"]).shape == (102, 64)
        assert len(where) == 601 and not any(where)  # every tokenize and the reply's encoding on a worker thread
    finally:
        live.stop()


def test_an_idle_pooling_server_gives_its_heap_back(monkeypatch):
    """trim_loop trims a pooling server (no generating engine) once no request is in flight."""
    import asyncio
    from types import SimpleNamespace

    import pagedllm.heap
    from pagedllm.entrypoints.openai.server_state import trim_loop

    trims = []
    monkeypatch.setattr(pagedllm.heap, "collect_and_trim", lambda: trims.append(1))
    pooling = SimpleNamespace(num_in_flight=1)
    state = SimpleNamespace(engine=None, pooling=pooling)

    async def run():
        task = asyncio.create_task(trim_loop(state, interval=0.01))
        try:
            await asyncio.sleep(0.2)
            assert not trims  # a request in flight: no trim
            pooling.num_in_flight = 0
            for _ in range(1000):
                if trims:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("an idle pooling server was never trimmed")
        finally:
            task.cancel()

    asyncio.run(run())
