"""Pipeline parallelism on CPU with gloo: PP=2 and PP=2 x TP=2 give PP=1's greedy tokens (also
under preemption, with prefix caching, chunked prefills, logprobs and seeded sampling); each
stage holds only its layers and a KV cache sized by them; uneven and bad pp_layer_partition; a
dead stage fails the engine fast."""
import os
from types import SimpleNamespace

import pytest

from dead_rank import assert_killed_rank_fails_fast
from one_engine import OneEngine
from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import layer_partition

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts((1, 9, 40, 130), seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("pp") / "llama4"), "llama", layers=4, heads=4, kv_heads=2)


ENGINES = OneEngine(dtype="float32", kv_cache_memory=4 << 20)  # PP engines; consecutive tests share one


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    ENGINES.close()


def run(path, prompts=PROMPTS, sp=SP, **kw):
    """(RequestOutputs, this run's preemptions and prefix-cache hits, executor facts) of an engine
    with these settings (pipeline parallel ones shared through ENGINES); asserts no block leaked."""
    kw.setdefault("kv_cache_memory", 4 << 20)
    if kw.get("pipeline_parallel_size", 1) * kw.get("tensor_parallel_size", 1) > 1:
        llm, owned = ENGINES.get(model=path, **kw), False
    else:
        ENGINES.close()  # a single-process engine resets the process's pipeline group (one_engine.py)
        llm, owned = LLM(model=path, dtype="float32", **kw), True
    try:
        before = llm.get_stats()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        stats = llm.get_stats()
        ex = llm.engine.core.executor
        facts = {"weights": ex.weight_bytes_per_rank, "blocks": ex.num_blocks}
    finally:
        if owned:
            llm.engine.shutdown()
    assert stats.num_free_blocks == stats.num_total_blocks
    counts = SimpleNamespace(num_preemptions=stats.num_preemptions - before.num_preemptions,
                             prefix_cache_hits=stats.prefix_cache_hits - before.prefix_cache_hits)
    return outs, counts, facts


def greedy(path, prompts=PROMPTS, sp=SP, **kw):
    outs, stats, facts = run(path, prompts, sp, **kw)
    return [o.outputs[0].token_ids for o in outs], stats, facts


@pytest.fixture(scope="module")
def reference(ckpt):
    return greedy(ckpt)


def test_pp2_matches_pp1_with_half_the_weights_and_cache_per_stage(ckpt, reference):
    want, _, one = reference
    got, _, two = greedy(ckpt, pipeline_parallel_size=2)
    assert got == want
    assert len(two["weights"]) == 2 and sum(two["weights"]) == pytest.approx(one["weights"][0], rel=0.01)
    assert two["blocks"] == 2 * one["blocks"]  # each stage caches 2 of the 4 layers in the same memory


def test_abort_while_in_flight(ckpt, reference):
    """A request aborted while its batch is in flight: its late output is dropped, the others
    finish with PP=1's tokens, every block comes back, and its id is reusable."""
    engine = ENGINES.get(model=ckpt, pipeline_parallel_size=2).engine  # test_pp2_matches_pp1's (the 4 requests fit)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, SP)
    done: dict = {}
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    in_flight = engine.core.scheduler.in_flight
    assert in_flight
    victim = sorted(in_flight)[0]
    engine.abort_request([victim])
    while engine.has_unfinished_requests() or engine.core.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    others = [str(i) for i in range(len(PROMPTS)) if str(i) != victim]
    assert [done[r].outputs[0].token_ids for r in others] == [reference[0][int(r)] for r in others]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not in_flight
    engine.add_request(victim, {"prompt_token_ids": PROMPTS[int(victim)]}, SP)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[victim].outputs[0].token_ids == reference[0][int(victim)]


def test_dead_stage_fails_fast(ckpt):
    llm = ENGINES.get(model=ckpt, pipeline_parallel_size=2)  # the tests' above, used up here (then replaced)
    assert_killed_rank_fails_fast(llm, PROMPTS[:2], SP)


def test_pp2_logprobs_and_seeded_sampling_match_pp1(ckpt):
    prompts = random_prompts((5, 40, 12), seed=13)
    sps = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=1.0, top_k=40, seed=7, n=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
    ]
    one, _, _ = run(ckpt, prompts, sps)
    two, _, _ = run(ckpt, prompts, sps, pipeline_parallel_size=2)
    for o1, o2 in zip(one, two):
        assert [c.token_ids for c in o2.outputs] == [c.token_ids for c in o1.outputs]
    lp1, lp2 = one[0].outputs[0].logprobs, two[0].outputs[0].logprobs
    assert [list(d) for d in lp2] == [list(d) for d in lp1]
    assert two[0].prompt_logprobs is not None and len(two[0].prompt_logprobs) == len(one[0].prompt_logprobs)


def test_pp2_tp2_matches_pp1(ckpt, reference):
    got, _, facts = greedy(ckpt, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert got == reference[0]
    assert len(facts["weights"]) == 4


def test_uneven_partition_and_chunked_prefill(ckpt, reference):
    """3 layers on stage 0, 1 on stage 1; a 32-token budget splits the long prompts; the cache
    holds what the 3-layer stage fits (every stage uses the same block count)."""
    got, stats, facts = greedy(ckpt, pipeline_parallel_size=2, pp_layer_partition="3,1", max_num_batched_tokens=32)
    assert got == reference[0]
    assert facts["weights"][0] > 2 * facts["weights"][1] * 0.9
    assert facts["blocks"] == int(reference[2]["blocks"] * 4 / 3)


SHARING = random_prompts((70, 70, 70, 70), seed=12)
SHARING += [p[:64] + [5, 6, 7] for p in SHARING[:2]]  # share 4 full blocks with earlier prompts
SHARING_SP = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def sharing_reference(ckpt):
    return greedy(ckpt, SHARING, SHARING_SP)[0]


def test_pp2_under_preemption(ckpt, sharing_reference):
    # per stage: 2 layers x 2 kv heads x 16 dims x 4 B x 2 = 512 B/token -> 24 blocks of 16 tokens
    got, stats, _ = greedy(ckpt, SHARING, SHARING_SP, pipeline_parallel_size=2, kv_cache_memory=512 * 16 * 24,
                           max_model_len=128)
    assert stats.num_preemptions > 0
    assert got == sharing_reference


def test_pp2_with_prefix_caching(ckpt, sharing_reference):
    got, stats, _ = greedy(ckpt, SHARING, SHARING_SP, pipeline_parallel_size=2, max_num_seqs=2)
    assert got == sharing_reference and stats.prefix_cache_hits > 0


def test_pp_batches_overlap_and_never_repeat_a_request_in_flight(ckpt, reference):
    """Two batches in flight (one per stage); a batch never schedules a request whose previous
    batch has not come back; outputs are applied in order (PP=1's tokens)."""
    llm = ENGINES.get(model=ckpt, pipeline_parallel_size=2, max_num_seqs=2)  # test_pp2_with_prefix_caching's
    core = llm.engine.core
    ex = core.executor
    depths, submit = [], ex.submit

    def checked_submit(so):
        assert not set(so.num_scheduled_tokens) & core.scheduler.in_flight
        depths.append(len(core._batch_queue))
        return submit(so)

    ex.submit = checked_submit
    try:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    finally:
        del ex.submit  # the shared engine's own method again
    assert [o.outputs[0].token_ids for o in outs] == reference[0]
    assert max(depths) == 1  # a second batch was submitted while one was in flight
    assert not core.scheduler.in_flight


@pytest.mark.parametrize("arch,kw", [
    ("qwen3", dict(tie=True, layers=3)),  # tied head: the last stage loads it from the embedding tensor
    ("qwen2_moe", dict(layers=3, extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=48))),
])
def test_pp2_other_llama_family_members(make_ckpt, arch, kw):
    path = make_ckpt(f"pp_{arch}", arch, heads=4, kv_heads=2, **kw)
    want, _, _ = greedy(path, PROMPTS[:3])
    got, _, _ = greedy(path, PROMPTS[:3], pipeline_parallel_size=2)  # 3 layers: 2 + 1
    assert got == want


@pytest.mark.parametrize("family", ["gpt2", "olmo2", "gemma2", "gemma3", "phi3", "gpt_bigcode"])
def test_pp2_dense_families(ckpt_dir, family):
    """Families with their own stage shapes: one tensor between stages (GPT-2's residual stream
    with the learned positions on stage 0 only, OLMo 2), Gemma's scaled embedding, soft-capped
    tied head and per-layer rotary types (Gemma 3: 6 layers, a global one on each stage); issue
    34's DecoderModel families, by GPTBigCode (multi-query, its learned positions on stage 0)."""
    from dense_checkpoints import make_dense_checkpoint

    path = make_dense_checkpoint(str(ckpt_dir / f"pp_dense_{family}"), family, layers=6 if family == "gemma3" else 2)
    want, _, _ = greedy(path, PROMPTS[:3])
    got, _, _ = greedy(path, PROMPTS[:3], pipeline_parallel_size=2)
    assert got == want


def test_pp2_deepseek_mla(make_ckpt):
    """MLA's one-plane latent cache per stage, a dense first layer then MoE layers."""
    extra = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                 n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32,
                 q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    path = make_ckpt("pp_deepseek", "deepseek_v3", layers=3, kv_heads=4, extra=extra)
    want, _, _ = greedy(path, PROMPTS[:3])
    got, _, _ = greedy(path, PROMPTS[:3], pipeline_parallel_size=2)
    assert got == want


def test_layer_partition_rules_and_bad_partitions(ckpt):
    assert layer_partition(10, 4) == [3, 3, 2, 2]  # the remainder goes to the first stages
    assert layer_partition(7, 2) == [4, 3]
    assert layer_partition(4, 2, [1, 3]) == [1, 3]
    assert EngineConfig(model=ckpt, pipeline_parallel_size=2, pp_layer_partition=[3, 1]).pp_layer_partition == (3, 1)
    with pytest.raises(ValueError, match="sums to 5"):
        layer_partition(4, 2, [2, 3])
    with pytest.raises(ValueError, match="has 3 stages"):
        EngineConfig(model=ckpt, pipeline_parallel_size=2, pp_layer_partition="1,1,2")
    with pytest.raises(ValueError, match="at least 1 layer"):
        EngineConfig(model=ckpt, pipeline_parallel_size=2, pp_layer_partition="4,0")
    with pytest.raises(ValueError, match="comma-separated"):
        EngineConfig(model=ckpt, pipeline_parallel_size=2, pp_layer_partition="4;0")
    with pytest.raises(ValueError, match="sums to 5"):  # checked against the model before any process starts
        LLM(model=ckpt, dtype="float32", pipeline_parallel_size=2, pp_layer_partition="2,3")
    with pytest.raises(ValueError, match="exceeds the model's 4 layers"):
        LLM(model=ckpt, dtype="float32", pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(model=ckpt, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(model=ckpt, pipeline_parallel_size=2, speculative_config={"method": "ngram",
                                                                               "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="LoRA"):
        EngineConfig(model=ckpt, pipeline_parallel_size=2, enable_lora=True)


def test_partition_from_the_environment(ckpt, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,3")
    assert EngineConfig(model=ckpt, pipeline_parallel_size=2).pp_layer_partition == (1, 3)
    assert EngineConfig(model=ckpt).pp_layer_partition is None


def test_unsupported_family_is_a_clear_error():
    from torch import nn

    from pagedllm.distributed.parallel_state import PPGroup, set_pp_group
    from pagedllm.models.pipeline import check_pipeline_support

    class SomeForCausalLM(nn.Module):  # a family without stages (supports_pp unset)
        pass

    ENGINES.close()  # the process's pipeline group is set by hand below: no engine may be using it
    set_pp_group(PPGroup(0, 2))
    try:
        with pytest.raises(ValueError, match="SomeForCausalLM does not support pipeline_parallel_size"):
            check_pipeline_support(SomeForCausalLM)
    finally:
        set_pp_group(PPGroup())
    check_pipeline_support(SomeForCausalLM)  # fine without pipeline parallelism


def test_data_parallel_replicas_get_a_core_per_pipeline_rank(ckpt):
    from pagedllm.entrypoints.router.data_parallel import replica_cpu_flags

    cfg = EngineConfig(model=ckpt, pipeline_parallel_size=2, cpu_threads_bind="auto")
    assert replica_cpu_flags(cfg, 2, allowed=list(range(8))) == [["--cpu-threads-bind", "0,1|2,3"],
                                                                 ["--cpu-threads-bind", "4,5|6,7"]]
    with pytest.raises(ValueError, match="needs 4 CPU cores"):
        replica_cpu_flags(cfg, 2, allowed=[0, 1, 2])


def test_pp2_structured_outputs_like_pp1(default_model):
    """The masks travel with the step to the last stage's sampling rank: PP=2 gives PP=1's
    constrained tokens (greedy and seeded)."""
    pytest.importorskip("xgrammar")
    from pagedllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}

    ENGINES.close()  # one multi-process engine per process: this test builds its own

    def run_structured(**kw):
        llm = LLM(default_model, dtype="float32", kv_cache_memory=16 << 20, max_model_len=256, **kw)
        try:
            params = [SamplingParams(max_tokens=40, temperature=t, seed=s,
                                     structured_outputs=StructuredOutputsParams(json=schema))
                      for t, s in ((0.0, None), (1.0, 3))]
            outs = llm.generate(["ROMEO:", "KING:"], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    one = run_structured()
    assert run_structured(pipeline_parallel_size=2) == one
    assert all(reason == "stop" for _, reason in one)
