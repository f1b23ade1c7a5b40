"""EAGLE speculative decoding end to end: greedy output token-identical to no speculation with
a random head (mostly rejected) under chunked prefill, prefix caching and preemption; a head
that reproduces a bigram target's next token by construction is accepted (mean accepted length
> 3 at k = 4), and so is the shipped head of the default model (> 1.5); sampled runs work and
follow the target at drafted positions; the loader maps EAGLE-1 checkpoints with and without
their own embedding, fc bias, a ``model.`` prefix, and pytorch_model.bin; the head module equals
the EAGLE-1 equations in plain torch; early consumption of long prompts' features proposes the
same drafts; unsupported targets are refused."""

import pytest
import torch
from eagle_heads import bigram_head_tensors, make_bigram_target, make_eagle_head
from prompts import random_prompts
from spec_runs import GREEDY, assert_second_tokens_follow_the_target, run, spec_config

from pagedllm import LLM, SamplingParams

def spec(head, k=3, **kw):
    return spec_config("eagle", head, k, **kw)


@pytest.fixture(scope="module")
def head(llama_ckpt, ckpt_dir):
    return make_eagle_head(str(ckpt_dir / "eagle_head"), llama_ckpt)


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    prompts = random_prompts((9, 30, 17, 41))
    return prompts, run(llama_ckpt, prompts)[0]


@pytest.fixture(scope="module")
def bigram(make_ckpt, ckpt_dir):
    target = make_bigram_target(str(ckpt_dir / "bigram_target"), make_ckpt)
    head = make_eagle_head(str(ckpt_dir / "bigram_head"), target, embedding=False, tensors=bigram_head_tensors)
    return target, head


@pytest.mark.parametrize("kw", [
    dict(block_size=16),
    dict(block_size=1, max_num_batched_tokens=20),  # chunked prefill
    dict(block_size=16, kv_cache_memory=12 * (8192 + 4096), max_model_len=96),  # preemption (12 blocks, both caches)
], ids=["bs16", "bs1-chunked", "preempt"])
def test_greedy_identical_random_head(llama_ckpt, head, reference, kw):
    prompts, ref = reference
    toks, s = run(llama_ckpt, prompts, speculative_config=spec(head), **kw)
    assert toks == ref
    assert s.spec_num_draft_tokens > 0
    if "max_model_len" in kw:
        assert s.num_preemptions > 0


def test_greedy_identical_with_prefix_cache(llama_ckpt, head, reference):
    prompts, ref = reference
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, block_size=4, speculative_config=spec(head, 4))
    for _ in range(2):  # the second round starts from cached prefixes (the head reuses their head K/V)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    s = llm.get_stats()
    assert s.prefix_cache_hits > 0 and s.num_free_blocks == s.num_total_blocks


@pytest.mark.parametrize("kw", [dict(), dict(block_size=1, max_num_batched_tokens=20)], ids=["plain", "chunked"])
def test_constructed_head_is_accepted(bigram, kw):
    """Accepted-length accounting: every emitted token of a drafting step is its accepted drafts
    plus one; the constructed head proposes what the target predicts, so most drafts pass."""
    target, head = bigram
    prompts = random_prompts((7, 25, 12))
    ref, _ = run(target, prompts)
    toks, s = run(target, prompts, speculative_config=spec(head, 4), **kw)
    assert toks == ref
    assert s.spec_num_drafts > 0
    mean_accepted_length = 1 + s.spec_num_accepted_tokens / s.spec_num_drafts
    assert mean_accepted_length > 3, (s.spec_num_accepted_tokens, s.spec_num_drafts)
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    assert list(s.spec_accepted_per_pos) == sorted(s.spec_accepted_per_pos, reverse=True)
    # each request: 1 token from prefill, then every step emits accepted + 1
    steps_tokens = sum(len(t) - 1 for t in toks)
    assert steps_tokens >= s.spec_num_drafts + s.spec_num_accepted_tokens


def test_sampled_runs(llama_ckpt, head, bigram):
    prompts = random_prompts((9, 30, 17))
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=7)
    a, s = run(llama_ckpt, prompts, sp, speculative_config=spec(head))
    b, _ = run(llama_ckpt, prompts, sp, speculative_config=spec(head))
    assert a == b and all(len(t) == 16 for t in a) and s.spec_num_draft_tokens > 0  # seeded: reproducible
    target, bhead = bigram
    _, s = run(target, prompts, SamplingParams(temperature=0.3, max_tokens=16, ignore_eos=True),
               speculative_config=spec(bhead, 4))
    assert s.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("variant", [
    dict(embedding=False, fc_bias=False),
    dict(prefix="model.", fmt="bin"),
    dict(layers=2, fmt="bin", embedding=False),
], ids=["shared-embedding", "prefixed-bin", "two-layers"])
def test_loader_variants(llama_ckpt, ckpt_dir, reference, variant):
    name = "eagle_" + "_".join(f"{k}{v}" for k, v in variant.items()).replace(".", "")
    head = make_eagle_head(str(ckpt_dir / name), llama_ckpt, **variant)
    prompts, ref = reference
    toks, s = run(llama_ckpt, prompts, speculative_config=spec(head))
    assert toks == ref and s.spec_num_draft_tokens > 0


def test_head_module_matches_a_plain_torch_reference(llama_ckpt, ckpt_dir):
    """EagleHead (our layers, paged attention) == the EAGLE-1 equations in plain torch."""
    import numpy as np
    from safetensors.torch import load_file

    from pagedllm.attention.backend import AttentionMetadata
    from pagedllm.attention.forward_context import set_attention_metadata
    from pagedllm.attention.selector import get_attention_backend
    from pagedllm.models.config_json import load_hf_config
    from pagedllm.models.eagle import EagleHead

    path = make_eagle_head(str(ckpt_dir / "eagle_ref2"), llama_ckpt, layers=2)
    hf = load_hf_config(path)
    torch.set_default_dtype(torch.float32)
    head = EagleHead(hf, True, True)
    head.load(path)
    T, H, bs = 11, hf.hidden_size, 4
    backend = get_attention_backend(torch.device("cpu"))
    a0 = head.attention_layers()[0]
    cache = torch.zeros(2, 2, 4, bs, a0.num_kv_heads, a0.head_dim)
    for i, layer in enumerate(head.attention_layers()):
        layer.bind(backend, cache[:, i])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.vocab_size, (T,), generator=g)
    feats = torch.randn(T, H, generator=g)
    table = np.array([[3, 1, 0]], dtype=np.int32)
    pos = np.arange(T)
    slots = table[0, pos // bs].astype(np.int64) * bs + pos % bs
    md = AttentionMetadata.from_host(np.array([0, T]), np.array([T]), table, slots, torch.device("cpu"))
    with torch.inference_mode(), set_attention_metadata(md):
        ours = head(head.embed_tokens(ids), feats, torch.from_numpy(pos))

    w = load_file(path + "/model.safetensors")
    nh, nkv = hf.num_attention_heads, hf.num_key_value_heads
    hd = H // nh
    eps = hf.rms_norm_eps

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    inv = 1.0 / (hf.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):  # [T, heads, hd], rotate-half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    x = torch.cat([w["embed_tokens.weight"][ids], feats], -1) @ w["fc.weight"].T + w["fc.bias"]
    for i in range(2):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"]) if i else x
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)).repeat_interleave(nh // nkv, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    torch.testing.assert_close(ours, x, atol=1e-4, rtol=1e-4)


def test_refusals(llama_ckpt, make_ckpt, ckpt_dir, head):
    other = make_ckpt("eagle_other_target", "llama", hidden=32, heads=2, kv_heads=1, intermediate=64)
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(model=other, kv_cache_memory=16 << 20, speculative_config=spec(head))
    sw = make_ckpt("eagle_sw_target", "mistral", sliding_window=8)
    sw_head = make_eagle_head(str(ckpt_dir / "eagle_sw_head"), sw)
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(model=sw, kv_cache_memory=16 << 20, speculative_config=spec(sw_head))
    with pytest.raises(ValueError, match="EAGLE-1"):  # a plain Llama is not a head
        LLM(model=llama_ckpt, kv_cache_memory=16 << 20, speculative_config=spec(llama_ckpt))
    with pytest.raises(ValueError, match="checkpoint directory"):
        LLM(model=llama_ckpt, kv_cache_memory=16 << 20, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_sampled_drafted_positions_follow_the_target(make_ckpt, ckpt_dir):
    """Tiny vocabulary: token 2 is drafted by a random head (q != p) and verified; its empirical
    distribution given token 1 equals HF's p(token 2 | prompt, token 1) (chi-square, fixed seeds)."""
    vocab = 8
    target = make_ckpt("tiny_vocab_target", "llama", vocab_size=vocab, layers=1, hidden=32, heads=2, kv_heads=1,
                       intermediate=64, init_std=0.6, seed=3)
    head = make_eagle_head(str(ckpt_dir / "tiny_vocab_eagle"), target, std=0.6, seed=9)
    prompt = [3, 5, 4, 6, 3, 7]
    n = 1500
    llm = LLM(model=target, dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=256, seed=11,
              speculative_config=spec(head, 1))
    outs = llm.generate(prompt_token_ids=[prompt] * n,
                        sampling_params=SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    s = llm.get_stats()
    assert s.spec_num_drafts == n and 0 < s.spec_num_accepted_tokens < n
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert_second_tokens_follow_the_target(pairs, target, prompt, vocab)


def test_early_consumption_of_long_prompts_proposes_the_same(llama_ckpt, head, monkeypatch):
    """A long chunked prompt's features consumed early (every 8 positions) or all at the first
    draft give the same head K/V, hence the same drafts."""
    from pagedllm.spec_decode.eagle import EagleProposer

    prompts = random_prompts((150, 90), seed=4)

    def drafts_with(max_pending):
        monkeypatch.setattr(EagleProposer, "MAX_PENDING", max_pending)
        llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=32,
                  speculative_config=spec(head, 3))
        drafter = llm.engine.core.executor.worker.drafter
        seen, inner = [], drafter.propose

        def record(runner, so, slots):
            out = inner(runner, so, slots)
            seen.append(sorted(out[0].items()))
            return out

        drafter.propose = record
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        return seen

    a, b = drafts_with(8), drafts_with(10_000)
    assert a == b and sum(len(d) for d in a) > 10


def test_shipped_head_for_the_default_model_is_accepted():
    """models/tiny-shakespeare-eagle (scripts/train_eagle_head.py): greedy output identical to
    plain decoding of the default model, and more than one token per drafted step."""
    import os

    from pagedllm.config import default_model_path

    head = os.path.join(os.path.dirname(default_model_path()), "tiny-shakespeare-eagle")
    prompts = ["ROMEO:\nWhat light", "First Citizen:\nBefore we proceed", "KING HENRY:\nNow, lords,"]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = LLM(kv_cache_memory=32 << 20).generate(prompts, sp, use_tqdm=False)
    llm = LLM(kv_cache_memory=32 << 20, speculative_config=spec(head, 3))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    s = llm.get_stats()
    assert 1 + s.spec_num_accepted_tokens / s.spec_num_drafts > 1.5, s


def test_accepted_length_accounting_is_exact(bigram):
    """The spec counters equal what the runner returned step by step: drafted rows, draft
    tokens, accepted drafts (emitted - 1 per drafted row) and acceptance per position; every
    output token is one of them or a plain row's token."""
    target, head = bigram
    llm = LLM(model=target, dtype="float32", kv_cache_memory=16 << 20, block_size=4, max_num_batched_tokens=24,
              speculative_config=spec(head, 4))
    runner = llm.engine.core.executor.worker.runner
    rows, inner = [], runner.execute

    def record(so):
        out = inner(so)
        for i, toks in enumerate(out.sampled_token_ids):
            rows.append((len(toks), out.num_draft_tokens[i] if out.num_draft_tokens else 0))
        return out

    runner.execute = record
    prompts = random_prompts((7, 25, 12, 40), seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 30, 17, 23)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    s = llm.get_stats()
    drafted = [(e, d) for e, d in rows if d]
    assert s.spec_num_drafts == len(drafted) > 0
    assert s.spec_num_draft_tokens == sum(d for _, d in drafted)
    assert s.spec_num_accepted_tokens == sum(e - 1 for e, _ in drafted)
    assert list(s.spec_accepted_per_pos) == [sum(e - 1 > j for e, _ in drafted) for j in range(4)]
    assert sum(e for e, _ in rows) == sum(len(o.outputs[0].token_ids) for o in outs) == 9 + 30 + 17 + 23
