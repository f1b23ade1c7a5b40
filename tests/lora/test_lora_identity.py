"""Greedy outputs with LoRA adapters equal HF transformers + PEFT with that adapter active, for
several adapters and the base mixed in one batch; under slot swapping (more adapters than slots);
with the per-step adapter cap; and the prefix cache never shares KV across adapters."""
import os

import pytest

from checkpoints import make_checkpoint
from peft_adapters import hf_peft_greedy, make_adapter
from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = tuple(tuple(p) for p in random_prompts((5, 17, 40), seed=3))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(str(d / "base"), "llama")
    adapters = {
        "all": make_adapter(base, str(d / "all"), r=8, alpha=16, seed=1),  # every projection
        "qv_down_rslora": make_adapter(base, str(d / "qvd"), r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                                       use_rslora=True, seed=2),
        "mlp": make_adapter(base, str(d / "mlp"), r=6, alpha=6, targets=("gate_proj", "up_proj"), seed=3),
    }
    refs = {name: hf_peft_greedy(base, path, PROMPTS, NEW) for name, path in adapters.items()}
    refs[None] = hf_peft_greedy(base, None, PROMPTS, NEW)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    return base, adapters, loras, refs


def mixed(loras, refs, names):
    items, reqs, want = [], [], []
    for name in names:
        for i, p in enumerate(PROMPTS):
            items.append(list(p))
            reqs.append(loras[name] if name else None)
            want.append(refs[name][i])
    return items, reqs, want


def generate(llm, items, reqs):
    outs = llm.generate(prompt_token_ids=items, sampling_params=GREEDY, lora_request=reqs, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_change_the_output(setup):
    _, _, _, refs = setup
    assert len({str(refs[n]) for n in refs}) == len(refs)  # B is non-zero: every adapter matters


@pytest.mark.parametrize("max_loras,per_step", [(4, None), (1, None), (3, 1)])
def test_mixed_batch_matches_hf_peft(setup, max_loras, per_step):
    """Base + 3 adapters in one generate call: 4 slots (all at once), 1 slot (requests wait for
    the slot and adapters swap in and out), and 3 slots with at most one adapter per step."""
    base, _, loras, refs = setup
    llm = LLM(model=base, dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=max_loras,
              max_lora_rank=8, max_loras_per_step=per_step)
    items, reqs, want = mixed(loras, refs, [None, "all", "qv_down_rslora", "mlp"])
    assert generate(llm, items, reqs) == want
    assert llm.engine.core.scheduler.lora_slots.users == [0] * max_loras  # every pin released


def test_prefix_cache_never_crosses_adapters(setup):
    base, _, loras, refs = setup
    llm = LLM(model=base, dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = [list(PROMPTS[2])]  # 40 tokens: two full blocks to cache
    first = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=loras["all"], use_tqdm=False)
    other = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=loras["mlp"], use_tqdm=False)
    plain = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, use_tqdm=False)
    again = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=loras["all"], use_tqdm=False)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == refs["all"][2]
    assert other[0].outputs[0].token_ids == refs["mlp"][2]
    assert plain[0].outputs[0].token_ids == refs[None][2]
    assert (first[0].num_cached_tokens, other[0].num_cached_tokens, plain[0].num_cached_tokens) == (0, 0, 0)
    assert again[0].num_cached_tokens == 32  # its own adapter's blocks are reused


def test_same_name_new_weights_is_a_new_adapter(setup, tmp_path):
    """An adapter re-registered under the same name with other weights never reuses the old KV."""
    base, adapters, loras, refs = setup
    llm = LLM(model=base, dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompt = [list(PROMPTS[2])]
    llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=loras["all"], use_tqdm=False)
    renamed = LoRARequest("all", 7, adapters["mlp"])  # the name "all", the weights of "mlp"
    out = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=renamed, use_tqdm=False)
    assert out[0].outputs[0].token_ids == refs["mlp"][2]
    assert out[0].num_cached_tokens == 0


def test_lora_request_needs_enable_lora(setup):
    base, _, loras, _ = setup
    llm = LLM(model=base, dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=loras["all"], use_tqdm=False)
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        LLM.generate(llm, [[5, 6, 7]], GREEDY, lora_request=[None, None], use_tqdm=False)


def test_chat_takes_a_lora_request(setup):
    base, _, loras, _ = setup
    llm = LLM(model=base, dtype="float32", kv_cache_memory=16 << 20, enable_lora=True, max_loras=1, max_lora_rank=8)
    conv = [{"role": "user", "content": "w5 w6 w7"}]
    with_lora = llm.chat(conv, GREEDY, use_tqdm=False, lora_request=loras["all"])[0]
    without = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    ids = with_lora.prompt_token_ids
    assert with_lora.outputs[0].token_ids == hf_peft_greedy(base, loras["all"].lora_path, (tuple(ids),), NEW)[0]
    assert without.outputs[0].token_ids != with_lora.outputs[0].token_ids
    assert os.path.isdir(loras["all"].lora_path)
