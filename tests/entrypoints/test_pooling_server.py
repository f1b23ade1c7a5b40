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


@pytest.fixture(scope="module")
def notypes_server(ckpt_dir):
    """A single-label cross-encoder whose tokenizer hands the model no token_type_ids."""
    yield from _served(ckpt_dir, "bert_rerank_notypes", "ce")


def test_single_label_classifier_pooling(notypes_server):
    """/pooling on a one-label classifier: each input's data a one-element list (vLLM's shape),
    for token-id inputs and base64 too."""
    live, offline = notypes_server
    ids = [o.prompt_token_ids for o in offline.classify(TEXTS)]
    ref = [o.outputs.probs for o in offline.classify(TEXTS)]
    r = httpx.post(live.url + "/pooling", json={"input": ids}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["object"] == "pooling" for d in data)
    assert all(len(d["data"]) == 1 for d in data) and np.allclose([d["data"] for d in data], ref, atol=1e-6)
    b64 = httpx.post(live.url + "/pooling", json={"input": TEXTS[2], "task": "classify", "encoding_format": "base64"},
                     timeout=60).json()
    assert np.allclose(np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4"), ref[2], atol=1e-6)


def test_cross_encoder_routes_without_token_types_match_hf(notypes_server):
    """/score and /rerank as HF's classifier scores the pairs the tokenizer builds (no segment ids)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    live, _ = notypes_server
    path = live.state.config.model
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    query, docs = "w30 w2", ["w2 w3", "w30 w31 w32", "w9"]
    with torch.no_grad():
        ref = [torch.sigmoid(hf(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    s = httpx.post(live.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert np.allclose([d["score"] for d in s["data"]], ref, atol=1e-5)
    r = httpx.post(live.url + "/rerank", json={"query": query, "documents": docs, "return_documents": False},
                   timeout=60).json()
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -ref[i])
    assert np.allclose([x["relevance_score"] for x in r["results"]], sorted(ref, reverse=True), atol=1e-5)
    # vLLM's rerank usage: the tokens of every (query, document) pair, as prompt_tokens and total_tokens
    pair_tokens = sum(len(tok(query, d)["input_ids"]) for d in docs)
    assert r["usage"] == {"prompt_tokens": pair_tokens, "total_tokens": pair_tokens}
    assert s["usage"]["prompt_tokens"] == pair_tokens


def test_tokenize_and_detokenize_on_a_pooling_server(notypes_server, monkeypatch):
    """/tokenize and /detokenize answer on a pooling server with the generating server's shapes."""
    live, offline = notypes_server
    tok = offline.get_tokenizer()
    text = "w11 w12 w13"
    r = httpx.post(live.url + "/tokenize", json={"model": "ce", "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": tok(text)["input_ids"], "count": 5, "max_model_len": live.state.pooling.max_model_len}
    bare = httpx.post(live.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert bare["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and bare["count"] == 3
    d = httpx.post(live.url + "/detokenize", json={"tokens": bare["tokens"]}, timeout=60)
    assert d.status_code == 200 and d.json() == {"prompt": tok.decode(bare["tokens"])}
    bad = httpx.post(live.url + "/detokenize", json={"tokens": [1, 10_000]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(live.url + "/tokenize", json={"prompt": text, "messages": [{"role": "user", "content": "w1"}]},
                      timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "user", "content": [{"type": "text", "text": "w3"}]}]
    untemplated = httpx.post(live.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert untemplated.status_code == 400 and untemplated.json()["error"]["param"] == "messages"
    served_tok = live.state.pooling.engine.tokenizer
    monkeypatch.setattr(served_tok, "chat_template", "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    chat = httpx.post(live.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == tok("w1 w2 w3 ", add_special_tokens=False)["input_ids"]
    wrong = httpx.post(live.url + "/tokenize", json={"model": "nope", "prompt": text}, timeout=60)
    assert wrong.status_code == 404


def test_models_report_max_model_len_on_a_pooling_server(embed_server):
    """/v1/models and /v1/models/{id} carry the pooling engine's max_model_len (as vLLM's ModelCard)."""
    live, _ = embed_server
    limit = live.state.pooling.max_model_len
    assert limit == 128  # the BERT checkpoint's max_position_embeddings
    cards = httpx.get(live.url + "/v1/models", timeout=60).json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("emb", limit)]
    assert httpx.get(live.url + "/v1/models/emb", timeout=60).json()["max_model_len"] == limit


def test_score_queries_and_documents(embed_server, notypes_server):
    """/score with vLLM 0.32's queries / documents: the same reply as text_1 / text_2 (one query
    against several documents, or pairwise lists), on an embedding model and a cross-encoder
    (HF's scores of the pairs); both spellings, neither, or half of one are 400s naming the field."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def scores(live, body):
        r = httpx.post(live.url + "/score", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    live, offline = embed_server
    one = scores(live, {"queries": "w5 w9", "documents": TEXTS})
    assert one["id"].startswith("score-") and one["model"] == "emb" and one["object"] == "list"
    old = scores(live, {"text_1": "w5 w9", "text_2": TEXTS})
    assert [d["index"] for d in one["data"]] == [0, 1, 2] and one["usage"] == old["usage"]
    assert np.allclose([d["score"] for d in one["data"]], [d["score"] for d in old["data"]], atol=1e-6)
    assert np.allclose([d["score"] for d in one["data"]], [o.outputs.score for o in offline.score("w5 w9", TEXTS)],
                       atol=1e-6)
    pairwise = scores(live, {"queries": TEXTS[:2], "documents": TEXTS[1:]})
    assert np.allclose([d["score"] for d in pairwise["data"]],
                       [offline.score(a, b)[0].outputs.score for a, b in zip(TEXTS[:2], TEXTS[1:])], atol=1e-6)

    live, _ = notypes_server
    path = live.state.config.model
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    query, docs = "w30 w2", ["w2 w3", "w30 w31 w32"]
    with torch.no_grad():
        ref = [torch.sigmoid(hf(**tok(query, d, return_tensors="pt")).logits[0, 0]).item() for d in docs]
    ce = scores(live, {"model": "ce", "queries": query, "documents": docs})
    assert np.allclose([d["score"] for d in ce["data"]], ref, atol=1e-5)
    assert ce["usage"]["prompt_tokens"] == sum(len(tok(query, d)["input_ids"]) for d in docs)

    for body, param in [({"text_1": "w1", "text_2": "w2", "queries": "w1"}, "queries"),
                        ({"text_1": "w1", "documents": ["w2"]}, "documents"),
                        ({}, "text_1"), ({"text_1": "w1"}, "text_2"),
                        ({"queries": "w1"}, "documents"), ({"documents": ["w1"]}, "queries"),
                        ({"queries": [], "documents": ["w1"]}, "queries")]:
        r = httpx.post(live.url + "/score", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert param in r.json()["error"]["message"]
    mismatched = httpx.post(live.url + "/score", json={"queries": ["w1", "w2"], "documents": ["w1", "w2", "w3"]},
                            timeout=60)
    assert mismatched.status_code == 400 and "queries and documents" in mismatched.json()["error"]["message"]
    extra = httpx.post(live.url + "/score", json={"queries": "w1", "documents": "w2", "query": "w1"}, timeout=60)
    assert extra.status_code == 400 and "query" in extra.json()["error"]["message"]


@pytest.fixture(scope="module")
def classify_server(ckpt_dir):
    """A three-label BERT sequence classifier (id2label neg / neu / pos)."""
    yield from _served(ckpt_dir, "bert_classify", "cls")


def test_classify_route_matches_hf(classify_server, notypes_server, embed_server):
    """/classify and /v1/classify in vLLM's shape: each input's softmax over the labels (a
    one-label head: [sigmoid]), the id2label name of the argmax, num_classes, usage; as HF's
    classifier computes them. A model that is not a classifier refuses it, naming the task."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def hf_probs(path: str, texts: list[str]):  # (each text's probabilities, the tokenizer)
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = [hf(**tok(t, return_tensors="pt")).logits[0] for t in texts]
        return [(torch.sigmoid(x) if x.numel() == 1 else torch.softmax(x, -1)).tolist() for x in logits], tok

    live, offline = classify_server
    ref, tok = hf_probs(live.state.config.model, TEXTS)
    names = ["neg", "neu", "pos"]
    for route in ("/classify", "/v1/classify"):
        r = httpx.post(live.url + route, json={"model": "cls", "input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "cls"
        assert isinstance(body["created"], int)
        tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
        assert body["usage"]["prompt_tokens"] == tokens and body["usage"]["total_tokens"] == tokens
        assert body["usage"]["completion_tokens"] == 0
        data = body["data"]
        assert [d["index"] for d in data] == [0, 1, 2] and all(d["num_classes"] == 3 for d in data)
        assert np.allclose([d["probs"] for d in data], ref, atol=1e-5)
        assert [d["label"] for d in data] == [names[int(np.argmax(p))] for p in ref]
    assert np.allclose([d["probs"] for d in data], [o.outputs.probs for o in offline.classify(TEXTS)], atol=1e-6)
    # one string; token ids; truncate_prompt_tokens
    one = httpx.post(live.url + "/classify", json={"input": TEXTS[2]}, timeout=60).json()
    assert len(one["data"]) == 1 and np.allclose(one["data"][0]["probs"], ref[2], atol=1e-5)
    ids = tok(TEXTS[0])["input_ids"]
    by_ids = httpx.post(live.url + "/classify", json={"input": [ids]}, timeout=60).json()
    assert np.allclose(by_ids["data"][0]["probs"], ref[0], atol=1e-5)
    short = httpx.post(live.url + "/classify", json={"input": TEXTS[0], "truncate_prompt_tokens": 3}, timeout=60).json()
    assert short["usage"]["prompt_tokens"] == 3
    assert np.allclose(short["data"][0]["probs"], hf_probs(live.state.config.model, ["w1"])[0][0], atol=1e-5)
    for body, param in [({"input": []}, "input"),
                        ({"input": "w1", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        bad = httpx.post(live.url + "/classify", json=body, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    extra = httpx.post(live.url + "/classify", json={"input": "w1", "top_n": 1}, timeout=60)
    assert extra.status_code == 400 and "top_n" in extra.json()["error"]["message"]
    wrong = httpx.post(live.url + "/classify", json={"input": "w1", "model": "nope"}, timeout=60)
    assert wrong.status_code == 404

    live, _ = notypes_server  # one label: [sigmoid], LABEL_0
    ref, _ = hf_probs(live.state.config.model, TEXTS)
    data = httpx.post(live.url + "/classify", json={"input": TEXTS}, timeout=60).json()["data"]
    assert all(d["num_classes"] == 1 and d["label"] == "LABEL_0" for d in data)
    assert np.allclose([d["probs"] for d in data], ref, atol=1e-5)

    live, _ = embed_server
    refused = httpx.post(live.url + "/classify", json={"input": "w1"}, timeout=60)
    assert refused.status_code == 400 and "'classify'" in refused.json()["error"]["message"], refused.text
    assert refused.json()["error"]["code"] == "unsupported_task"
