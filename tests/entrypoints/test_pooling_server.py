"""The pooling routes on a live server (``runner="pooling"``): the official openai client's
embeddings.create (its default base64 and float), /pooling, /score, /rerank and /v1/rerank in
vLLM's shapes with the offline LLM's values, and the refusals (unknown fields, generation on a
pooling server, embeddings on a generative one)."""
from __future__ import annotations

import base64
import httpx
import numpy as np
import pytest
from conftest import LiveServer, wait_ready
from pooling_checkpoints import make_pooling_checkpoint

from pagedllm import LLM

TEXTS = ["w1 w5 w9 w13", "w7", "w20 w21 w22 w23"]


def _serve(path: str, name: str) -> LiveServer:
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app

    return wait_ready(LiveServer(build_app(EngineConfig(model=path, served_model_name=name, dtype="float32",
                                                        runner="pooling"))), "pooling")


def _served(ckpt_dir, kind: str, name: str):
    """(live server, offline LLM) over one checkpoint."""
    path = make_pooling_checkpoint(str(ckpt_dir / f"pool_{kind}"), kind)
    live = _serve(path, name)
    yield live, LLM(model=path, dtype="float32", runner="pooling")
    live.stop()


@pytest.fixture(scope="module")
def embed_server(ckpt_dir):
    yield from _served(ckpt_dir, "bert_mean", "emb")


@pytest.fixture(scope="module")
def rerank_server(ckpt_dir):
    yield from _served(ckpt_dir, "bert_rerank", "rr")


def test_openai_client_embeddings(embed_server):
    import openai

    live, offline = embed_server
    ref = [o.outputs.embedding for o in offline.embed(TEXTS)]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
    assert np.allclose([d.embedding for d in r.data], ref, atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS))
    one = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float", dimensions=8)
    assert len(one.data[0].embedding) == 8
    assert np.allclose(one.data[0].embedding, offline.embed(TEXTS[0], dimensions=8)[0].outputs.embedding, atol=1e-6)
    ids = offline.embed(TEXTS[1])[0].prompt_token_ids
    by_ids = client.embeddings.create(model="emb", input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, ref[1], atol=1e-6)


def test_pooling_and_score_routes(embed_server):
    live, offline = embed_server
    r = httpx.post(live.url + "/pooling", json={"input": TEXTS[:2], "encoding_format": "base64"}, timeout=60).json()
    assert r["object"] == "list" and r["id"].startswith("pool-") and r["data"][0]["object"] == "pooling"
    vec = np.frombuffer(base64.b64decode(r["data"][0]["data"]), dtype="<f4")
    assert np.allclose(vec, offline.embed(TEXTS[0])[0].outputs.embedding, atol=1e-6)
    tok = httpx.post(live.url + "/pooling", json={"input": TEXTS[1], "task": "token_embed"}, timeout=60).json()
    assert np.array(tok["data"][0]["data"]).shape == (3, 64)  # [CLS] w7 [SEP]
    s = httpx.post(live.url + "/score", json={"text_1": "w5 w9", "text_2": TEXTS}, timeout=60).json()
    ref = [o.outputs.score for o in offline.score("w5 w9", TEXTS)]
    assert [d["index"] for d in s["data"]] == [0, 1, 2] and np.allclose([d["score"] for d in s["data"]], ref, atol=1e-6)


def test_truncate_prompt_tokens_routes(embed_server, rerank_server):
    live, offline = embed_server
    long = " ".join(f"w{i}" for i in range(1, 300))
    r = httpx.post(live.url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 8}, timeout=60).json()
    ref = offline.embed(long, truncate_prompt_tokens=8)[0].outputs.embedding
    assert r["usage"]["prompt_tokens"] == 8 and np.allclose(r["data"][0]["embedding"], ref, atol=1e-6)
    live, offline = rerank_server
    r = httpx.post(live.url + "/rerank", json={"query": "w5", "documents": [long], "truncate_prompt_tokens": 12},
                   timeout=60).json()
    assert r["usage"]["total_tokens"] == 12
    assert np.isclose(r["results"][0]["relevance_score"],
                      offline.score("w5", long, truncate_prompt_tokens=12)[0].outputs.score, atol=1e-6)


def test_rerank_routes(rerank_server):
    live, offline = rerank_server
    ref = [o.outputs.score for o in offline.score("w5 w9 w40", TEXTS)]
    for route in ("/rerank", "/v1/rerank"):
        r = httpx.post(live.url + route, json={"model": "rr", "query": "w5 w9 w40", "documents": TEXTS, "top_n": 2},
                       timeout=60).json()
        assert r["id"].startswith("rerank-") and r["model"] == "rr" and r["usage"]["total_tokens"] > 0
        order = sorted(range(3), key=lambda i: -ref[i])[:2]
        assert [x["index"] for x in r["results"]] == order
        assert [x["document"]["text"] for x in r["results"]] == [TEXTS[i] for i in order]
        assert np.allclose([x["relevance_score"] for x in r["results"]], [ref[i] for i in order], atol=1e-6)
    # a cross-encoder does not embed
    bad = httpx.post(live.url + "/v1/embeddings", json={"input": "w1"}, timeout=60)
    assert bad.status_code == 400 and "embed" in bad.json()["error"]["message"]


def test_refusals(embed_server, server):
    live, _ = embed_server
    extra = httpx.post(live.url + "/v1/embeddings", json={"input": "w1", "best_of": 3}, timeout=60)
    assert extra.status_code == 400 and "best_of" in extra.json()["error"]["message"]
    zero = httpx.post(live.url + "/v1/embeddings", json={"input": "w1", "truncate_prompt_tokens": 0}, timeout=60)
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"
    gen = httpx.post(live.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2}, timeout=60)
    assert gen.status_code == 400 and "pooling" in gen.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200
    long = httpx.post(live.url + "/v1/embeddings", json={"input": " ".join(["w1"] * 300)}, timeout=60)
    assert long.status_code == 400 and "max_model_len" in long.json()["error"]["message"]
    empty = httpx.post(live.url + "/v1/embeddings", json={"input": []}, timeout=60)
    assert empty.status_code == 400
    wrong = httpx.post(live.url + "/v1/embeddings", json={"input": "w1", "model": "nope"}, timeout=60)
    assert wrong.status_code == 404
    on_generative = httpx.post(server.url + "/v1/embeddings", json={"input": "w1"}, timeout=60)
    assert on_generative.status_code == 400 and "--runner pooling" in on_generative.json()["error"]["message"]
