"""--logits-processors (vLLM v1's batch logits processor interface): the batch updates a processor
is told, a processor applied offline (forced rows, others untouched, greedy and random rows),
its validate_params as the request's error, and the start-up errors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.sample.logits_processors import BatchProcessors

FORCE = "batch_logits_plugins:ForceToken"
ENGINE_KW = dict(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, seed=0)


def state(rid, force=None):
    return SimpleNamespace(req_id=rid, token_ids=[1, 2, 3], num_prompt_tokens=2,
                           sampling_params=SamplingParams(extra_args=None if force is None else {"force_token": force}))


def test_batch_updates_follow_the_rows():
    procs = BatchProcessors([__import__("batch_logits_plugins").ForceToken], None, None)
    p = procs.processors[0]
    a, b, c, d = state("a", 5), state("b"), state("c", 9), state("d", 4)
    procs.update([a, b])
    u = p.updates[-1]
    assert u.batch_size == 2 and list(u.removed) == [] and [(i, pr[:]) for i, _, pr, _ in u.added] == [(0, [1, 2]),
                                                                                                         (1, [1, 2])]
    out = u.added[0][3]
    assert list(out) == [3] and len(out) == 1
    a.token_ids.append(8)  # a live view: it grows with the request
    assert list(out) == [3, 8] and out[-1] == 8
    procs.update([a, b])  # same rows, same order: no update
    assert len(p.updates) == 1 and p.rows == {0: 5}
    procs.update([b, c])  # a left, b moved up
    u = p.updates[-1]
    assert sorted(u.removed) == [0, 1] and [i for i, *_ in u.added] == [0, 1] and p.rows == {1: 9}
    procs.update([b, c, d])  # d joins at the end only
    u = p.updates[-1]
    assert list(u.removed) == [] and [i for i, *_ in u.added] == [2] and p.rows == {1: 9, 2: 4}
    procs.update([d])
    assert p.rows == {0: 4}


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    from pagedllm.entrypoints.llm import LLM

    return LLM(model=llama_ckpt, logits_processors=[FORCE], **ENGINE_KW)


def test_processor_applies_to_its_rows_only(llm):
    prompts = ["w1 w2 w3", "w4 w5 w6 w7", "w8 w9"]
    forced = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, extra_args={"force_token": 7})
    random_forced = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True,
                                   extra_args={"force_token": 11})
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, [forced, plain, random_forced], use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == [7] * 5
    assert list(outs[2].outputs[0].token_ids) == [11] * 5
    alone = llm.generate([prompts[1]], plain, use_tqdm=False)[0]
    assert list(outs[1].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert list(alone.outputs[0].token_ids) != [7] * 5


def test_validate_params_refuses_the_request(llm):
    with pytest.raises(ValueError, match="force_token"):
        llm.generate(["w1"], SamplingParams(max_tokens=1, extra_args={"force_token": "seven"}), use_tqdm=False)


def test_start_up_errors_name_the_processor(llama_ckpt):
    from pagedllm.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="NotAProcessor.*not a subclass"):
        LLM(model=llama_ckpt, logits_processors=["batch_logits_plugins:NotAProcessor"], **ENGINE_KW)
    with pytest.raises(ValueError, match="cannot load 'no_such_module:X'"):
        LLM(model=llama_ckpt, logits_processors=["no_such_module:X"], **ENGINE_KW)
    with pytest.raises(ValueError, match="qualified"):
        EngineConfig(model=llama_ckpt, logits_processors=[3])
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=llama_ckpt, logits_processors=[FORCE],
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    from pagedllm.entrypoints.cli import _build_parser, engine_config_from_args

    args = _build_parser().parse_args(["serve", "--model", llama_ckpt, "--logits-processors", FORCE,
                                       "batch_logits_plugins.ForceToken"])
    assert engine_config_from_args(args).logits_processors == (FORCE, "batch_logits_plugins.ForceToken")
