"""Gemma 2, Gemma 3, Phi-3, OLMo 2, GPT-2 and issue 34's families (GPT-NeoX, Falcon in its three
layouts incl. ALiBi, Phi, StableLM, Starcoder2, GPTBigCode, Granite, Cohere): greedy outputs token-identical to HF transformers
(float32) on prompts longer than the sliding window, under chunked prefill, preemption, prefix
caching and block sizes 1 and 16; sampled-token logprobs equal HF's log-softmax (which shows the
soft-caps: a final logit cap never changes an argmax)."""
import functools

import pytest
import torch

from checkpoints import hf_greedy
from prompts import random_prompts
from dense_checkpoints import WINDOW, make_dense_checkpoint
from pagedllm import LLM, SamplingParams

FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "gpt2", "gpt_neox", "falcon", "falcon_mqa", "falcon_alibi", "phi",
            "stablelm", "starcoder2", "gpt_bigcode", "granite", "cohere")
WINDOWED = ("phi3", "starcoder2")  # a sliding window on every layer
NEW = 16


def prompts():
    base = random_prompts((100,), seed=5)[0]
    other = random_prompts((3, 45), seed=6)
    # longer than the window; two share a 64-token prefix with the longest (prefix caching)
    return [base[:64] + other[1][:20], other[0], base, other[1], base[:80]]


@functools.lru_cache(maxsize=None)
def reference(path: str):
    """HF greedy continuations, and the log-softmax rows over prompt + continuation."""
    from transformers import AutoModelForCausalLM

    # Falcon's ALiBi: HF's SDPA path (its eager path adds the bias twice in current transformers)
    kw = {"attn_implementation": "sdpa"} if path.endswith("alibi") else {}
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    outs, rows = [], []
    with torch.no_grad():
        for p in prompts():
            ids = torch.tensor([p])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
            rows.append(torch.log_softmax(m(g).logits[0, len(p) - 1 : -1].float(), dim=-1))
    return outs, rows


@pytest.fixture(scope="module")
def ckpts(ckpt_dir):
    return {f: make_dense_checkpoint(str(ckpt_dir / f"dense_{f}"), f, layers=4 if f == "gemma3" else 2)
            for f in FAMILIES}


def generate(path, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    llm = LLM(model=path, dtype="float32", **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=sp, use_tqdm=False)
    return llm, outs


def check(outs, ref) -> None:
    greedy, rows = ref
    assert [o.outputs[0].token_ids for o in outs] == greedy
    for o, row in zip(outs, rows):
        c = o.outputs[0]
        for j, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(lps[tok].logprob - row[j, tok].item()) < 1e-4, (j, lps[tok].logprob, row[j, tok].item())


@pytest.mark.parametrize("family", FAMILIES)
def test_block16_chunked_prefill_preemption_prefix_caching(ckpts, family):
    """Block size 16, prompt chunks of 24 tokens, a cache too small for all five requests at once
    (preemption), prefix caching on; then the same prompts again (prefix-cache hits)."""
    path = ckpts[family]
    # 12 blocks: the longest request (100 + 16 tokens = 8 blocks) fits alone, not the five together.
    # Phi-3 and Starcoder2 window every layer, so a request holds at most window + chunk: 6 blocks make it preempt.
    llm, outs = generate(path, block_size=16, max_num_batched_tokens=24, enable_prefix_caching=True,
                         num_gpu_blocks_override=6 if family in WINDOWED else 12, max_model_len=160)
    check(outs, reference(path))
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    again = llm.generate(prompt_token_ids=prompts(), sampling_params=SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference(path)[0]
    assert llm.get_stats().prefix_cache_hits > stats.prefix_cache_hits
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_total_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_block1(ckpts, family):
    path = ckpts[family]
    llm, outs = generate(path, block_size=1, max_num_batched_tokens=64)
    check(outs, reference(path))


def test_prompts_cross_the_window():
    assert sum(len(p) > WINDOW for p in prompts()) >= 4


def test_yarn_rope_scaling_matches_hf(make_ckpt):
    """YaRN in the shared rotary layer (long-context Qwen, DeepSeek), on a Llama checkpoint whose
    prompts run past original_max_position_embeddings."""
    path = make_ckpt("llama_yarn", "llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32})
    ps = random_prompts((5, 60), seed=2)
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                            ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, ps, NEW)
