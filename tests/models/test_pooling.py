"""The pooling runner against HF transformers in float32: BERT mean-pooled (sentence-transformers
config) and XLM-RoBERTa CLS embeddings, a Qwen3 decoder's last-token embeddings, cross-encoder
scores equal to sigmoid(HF's classification head) for BERT and XLM-RoBERTa pairs; every call's
inputs batched into one forward; Matryoshka truncation; the refusals."""
import functools

import pytest
import torch
import torch.nn.functional as F

from pooling_checkpoints import make_pooling_checkpoint
from pagedllm import LLM

TEXTS = ["w1 w5 w9 w13", "w7", "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31", "w3 w3 w3 w8 w100"]
QUERY = "w5 w9 w40"


@pytest.fixture(scope="module")
def ckpts(ckpt_dir):
    kinds = ("bert_mean", "xlmr_cls", "bert_rerank", "xlmr_rerank", "qwen3_embed", "bert_rerank_notypes")
    return {k: make_pooling_checkpoint(str(ckpt_dir / f"pool_{k}"), k) for k in kinds}


@functools.lru_cache(maxsize=None)
def llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", runner="pooling", **kw)


def hf_hidden(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    m = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).last_hidden_state[0]


def count_forwards(monkeypatch, model: LLM) -> list:
    calls = []
    runner = model.pooling.runner
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda seqs, types=None: calls.append(len(seqs)) or real(seqs, types))
    return calls


@pytest.mark.parametrize("kind,pooling", [("bert_mean", "MEAN"), ("xlmr_cls", "CLS"), ("qwen3_embed", "LAST")])
def test_embeddings_match_hf(ckpts, monkeypatch, kind, pooling):
    path = ckpts[kind]
    model = llm(path)
    assert model.pooling.pooler.pooling_type == pooling and model.pooling.pooler.normalize
    tok = model.get_tokenizer()
    prompts = TEXTS if kind != "qwen3_embed" else [[5, 9, 13, 40], [7], list(range(20, 50)), [3, 3, 8]]
    calls = count_forwards(monkeypatch, model)
    outs = model.embed(prompts) if kind != "qwen3_embed" else model.embed(prompt_token_ids=prompts)
    assert calls == [len(prompts)]  # every input in one forward
    for p, o in zip(prompts, outs):
        ids = tok(p)["input_ids"] if isinstance(p, str) else p
        assert o.prompt_token_ids == ids
        h = hf_hidden(path, ids)
        ref = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1]}[pooling]
        got = torch.tensor(o.outputs.embedding)
        assert F.cosine_similarity(got, F.normalize(ref, dim=0), dim=0) > 0.99999
        assert abs(got.norm().item() - 1) < 1e-5


@pytest.mark.parametrize("kind", ["bert_rerank", "xlmr_rerank"])
def test_cross_encoder_scores_match_hf_head(ckpts, kind):
    from transformers import AutoModelForSequenceClassification

    path = ckpts[kind]
    model = llm(path)
    outs = model.score(QUERY, TEXTS)
    tok = model.get_tokenizer()
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for t in TEXTS:
            enc = tok(QUERY, t, return_tensors="pt", return_token_type_ids=kind.startswith("bert"))
            refs.append(torch.sigmoid(hf(**enc).logits[0, 0]).item())
    assert [round(o.outputs.score, 5) for o in outs] == [round(r, 5) for r in refs]
    assert len(set(round(r, 4) for r in refs)) > 1  # the pairs score differently
    probs = model.classify(TEXTS)
    assert all(o.outputs.num_classes == 1 and 0 < o.outputs.probs[0] < 1 for o in probs)


def test_cross_encoder_without_token_types_matches_hf(ckpts):
    """A tokenizer whose model_input_names lacks token_type_ids hands the model none (HF and
    sentence-transformers call it so): every token is segment 0, the second text's too."""
    from transformers import AutoModelForSequenceClassification

    path = ckpts["bert_rerank_notypes"]
    model = llm(path)
    tok = model.get_tokenizer()
    firsts, seconds = TEXTS, [QUERY, "w2", QUERY, "w60 w61"]  # pairwise, the query second
    outs = model.score(firsts, seconds)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    refs, with_types = [], []
    with torch.no_grad():
        for a, b in zip(firsts, seconds):
            enc = tok(a, b, return_tensors="pt")
            assert "token_type_ids" not in enc
            refs.append(torch.sigmoid(hf(**enc).logits[0, 0]).item())
            typed = tok(a, b, return_tensors="pt", return_token_type_ids=True)
            with_types.append(torch.sigmoid(hf(**typed).logits[0, 0]).item())
    assert [round(o.outputs.score, 5) for o in outs] == [round(r, 5) for r in refs]
    assert max(abs(r - t) for r, t in zip(refs, with_types)) > 1e-3  # segment ids 1 would score otherwise
    ids, types = model.pooling.tokenize_pair(QUERY, "w2")
    assert ids == tok(QUERY, "w2")["input_ids"] and types == [0] * 7  # [CLS] w5 w9 w40 [SEP] w2 [SEP]


def test_score_with_an_embedding_model_is_cosine(ckpts):
    model = llm(ckpts["bert_mean"])
    emb = model.embed([QUERY] + TEXTS)
    q = torch.tensor(emb[0].outputs.embedding)
    outs = model.score(QUERY, TEXTS)
    for e, o in zip(emb[1:], outs):
        assert abs(o.outputs.score - F.cosine_similarity(q, torch.tensor(e.outputs.embedding), dim=0).item()) < 1e-5


def test_matryoshka_dimensions_and_token_embed(ckpts):
    model = llm(ckpts["bert_mean"])
    full = model.encode(TEXTS[:2], pooling_task="token_embed")
    short = model.embed(TEXTS[:2], dimensions=16)
    for f, s in zip(full, short):
        ref = F.normalize(f.outputs.data.mean(0)[:16], dim=0)
        assert len(s.outputs.embedding) == 16
        assert F.cosine_similarity(torch.tensor(s.outputs.embedding), ref, dim=0) > 0.99999
    with pytest.raises(ValueError, match="dimensions"):
        model.embed(TEXTS[:1], dimensions=65)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm(ckpts["xlmr_cls"]).embed(TEXTS[:1], dimensions=16)


def test_budget_splits_into_several_forwards(ckpts, monkeypatch):
    model = LLM(model=ckpts["xlmr_cls"], dtype="float32", max_num_seqs=2)
    assert model.pooling is not None  # detected from the architecture (runner "auto")
    calls = count_forwards(monkeypatch, model)
    assert len(model.embed(TEXTS)) == 4 and calls == [2, 2]


def test_refusals(ckpts):
    model = llm(ckpts["bert_mean"])
    with pytest.raises(ValueError, match="pooling model"):
        model.generate(["w1"])
    with pytest.raises(ValueError, match="max_model_len"):
        model.embed(" ".join(["w1"] * 200))
    with pytest.raises(ValueError, match="token ids"):
        model.embed(prompt_token_ids=[[1, 5000]])
    with pytest.raises(ValueError, match="not supported"):
        llm(ckpts["bert_rerank"]).embed(TEXTS[:1])
    with pytest.raises(ValueError, match="runner must be"):
        LLM(model=ckpts["bert_mean"], runner="embed")


def test_truncate_prompt_tokens(ckpts):
    """vLLM's truncate_prompt_tokens: a text keeps its first N tokens by the tokenizer's own
    truncation ([CLS] ... [SEP] kept), token ids their last N, -1 is max_model_len; a pair is cut to
    N with its separators; bad values are refused naming the field."""
    model = llm(ckpts["bert_mean"])
    tok, long = model.get_tokenizer(), " ".join(f"w{i}" for i in range(1, 300))
    cut = model.embed(long, truncate_prompt_tokens=8)[0]
    assert cut.prompt_token_ids == tok(long, truncation=True, max_length=8)["input_ids"]
    assert cut.outputs.embedding == model.embed(prompt_token_ids=[cut.prompt_token_ids])[0].outputs.embedding
    assert len(model.embed(long, truncate_prompt_tokens=-1)[0].prompt_token_ids) == model.pooling.max_model_len
    assert model.embed(prompt_token_ids=[[5, 6, 7, 8]], truncate_prompt_tokens=2)[0].prompt_token_ids == [7, 8]
    for bad in (0, -2, 10_000):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            model.embed(long, truncate_prompt_tokens=bad)
    rerank = llm(ckpts["bert_rerank"])
    ids, types = rerank.pooling.tokenize_pair(QUERY, long, 10)
    assert ids == rerank.get_tokenizer()(QUERY, long, truncation=True, max_length=10)["input_ids"]
    assert ids[0] == ids[-1] - 1 and len(types) == 10  # [CLS] (2) ... [SEP] (3)
    assert 0 < rerank.score(QUERY, long, truncate_prompt_tokens=10)[0].outputs.score < 1


def test_concurrent_callers_share_forwards(ckpts, monkeypatch):
    """Inputs of callers arriving while a forward runs go into the next forward together."""
    import threading
    import time

    model = llm(ckpts["xlmr_cls"])
    runner, batcher = model.pooling.runner, model.pooling.batcher
    real, calls = runner.run, []

    def run(seqs, types=None):
        if not calls:  # the first forward waits until two more callers are queued behind it
            deadline = time.monotonic() + 30
            while len(batcher.pending) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        calls.append(len(seqs))
        return real(seqs, types)

    monkeypatch.setattr(runner, "run", run)
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, model.embed(TEXTS[i]))) for i in range(3)]
    threads[0].start()
    while not calls and not batcher.busy:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert calls == [1, 2]
    alone = model.embed(TEXTS[:3])
    for i in range(3):
        assert results[i][0].outputs.embedding == pytest.approx(alone[i].outputs.embedding, abs=1e-6)
