"""kv_cache_dtype end to end on a tiny Llama (float32 model): validation, capacity, logprobs close to
the full-precision cache, and prefix caching / preemption exact with respect to the same 8-bit
cache, with the C++ kernels and with the pure-torch paths on CPU; with a GPU visible (device auto
-> cuda) through the Triton backend instead (its kernels against torch_native:
tests/attention/test_triton_kv8.py)."""
import math
from types import SimpleNamespace

import pytest
import torch

from prompts import random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.attention.kv_quant import kv_quant, kv_storage_dtype
from pagedllm.config import EngineConfig
from pagedllm.kernels import cpu as cpu_kernel_module
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.worker.worker import KVCacheSpec

STEPS = 8
LOGPROBS = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# mean / max |logprob(fp cache) - logprob(8-bit cache)| over the top-20 tokens of the first
# decode steps (while both runs agree on the tokens so far); measured on this model: bfloat16
# 0.0013 / 0.0059, int8 0.0018 / 0.011, fp8_e4m3 0.013 / 0.078, fp8_e5m2 0.027 / 0.14
TOLERANCE = {"bfloat16": (0.004, 0.02), "int8": (0.006, 0.04), "fp8_e4m3": (0.04, 0.25), "fp8_e5m2": (0.08, 0.45)}
ON_CUDA = torch.cuda.is_available()
# the attention paths an 8-bit cache takes: on CPU the C++ kernels and the pure-torch paths; on
# CUDA the Triton backend (None: nothing to switch)
PATHS = ([pytest.param(None, id="triton")] if ON_CUDA
         else [pytest.param(True, id="cpu_kernels"), pytest.param(False, id="torch")])


def _engine_kwargs(monkeypatch, cpu_kernels) -> dict:
    if cpu_kernels is None:
        return {}
    if not cpu_kernels:  # kernels loaded earlier in this process would still be used
        monkeypatch.setattr(cpu_kernel_module, "ready", lambda: None)
    return {"cpu_kernels": cpu_kernels}


def _check_backend(llm) -> None:
    """The 8-bit cache really went through the backend of the device."""
    assert llm.engine.core.executor.worker.backend.name == ("triton" if ON_CUDA else "torch_native")


def test_config_validation(llama_ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model=llama_ckpt, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=llama_ckpt, kv_cache_dtype="float8")
    assert EngineConfig(model=llama_ckpt, kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"


@pytest.mark.skipif(ON_CUDA, reason="the GGUF default applies where the model runs on the CPU")
def test_gguf_on_cpu_defaults_to_a_bfloat16_cache(tmp_path, llama_ckpt):
    """A GGUF file on the CPU with dtype auto keeps a bfloat16 cache (llama.cpp keeps f16); an
    explicit dtype or kv_cache_dtype keeps what it says, and an HF checkpoint keeps the model dtype."""
    from gguf_files import write_gguf

    path = write_gguf(str(tmp_path / "tiny.gguf"), "Q8_0")
    assert EngineConfig(model=path).kv_cache_dtype == "bfloat16"
    assert EngineConfig(model=str(tmp_path)).kv_cache_dtype == "bfloat16"  # a folder with one .gguf
    assert EngineConfig(model=path, dtype="float32").kv_cache_dtype == "auto"
    assert EngineConfig(model=path, kv_cache_dtype="float32").kv_cache_dtype == "float32"
    assert EngineConfig(model=llama_ckpt).kv_cache_dtype == "auto"
    llm = LLM(model=path, kv_cache_memory=4 << 20)
    worker = llm.engine.core.executor.worker
    assert worker.kv_cache.dtype == torch.bfloat16 and worker.dtype == torch.float32
    full = LLM(model=path, kv_cache_dtype="float32", kv_cache_memory=4 << 20)
    assert full.engine.core.executor.worker.kv_cache.dtype == torch.float32
    assert llm.get_stats().num_total_blocks >= 1.9 * full.get_stats().num_total_blocks  # same memory, 2x tokens
    out = llm.generate(prompt_token_ids=[list(range(3, 23))], sampling_params=GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def test_float32_cache_needs_a_float32_model(llama_ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' keeps a float32 model's cache"):
        LLM(model=llama_ckpt, dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory=4 << 20)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_dtype="float32", kv_cache_memory=4 << 20)
    assert llm.engine.core.executor.worker.kv_cache.dtype == torch.float32


def test_latent_attention_refused(make_ckpt):
    """DeepSeek's one-plane latent cache has no 8-bit form: a clear error at start-up."""
    extra = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                 n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16)
    path = make_ckpt("kvq_deepseek", "deepseek_v3", layers=2, kv_heads=4, extra=extra)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8': multi-head latent attention"):
        LLM(model=path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory=4 << 20)


def test_capacity_at_least_1_9x_bfloat16(make_ckpt):
    """Same memory, head dim 64: the 8-bit caches hold >= 1.9x the tokens of a bf16 one (the
    1.1B benchmark model's shape as well, by the spec)."""
    path = make_ckpt("kvq_hd64", "llama", hidden=128, heads=2, kv_heads=1, intermediate=128)
    tokens = {}
    for name in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(model=path, dtype="bfloat16", kv_cache_dtype=name, kv_cache_memory=4 << 20, max_num_seqs=1024)
        _check_backend(llm)
        s = llm.get_stats()
        tokens[name] = s.num_total_blocks * 16
        if name != "auto":
            out = llm.generate(prompt_token_ids=random_prompts((30,)), sampling_params=GREEDY, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 12
    assert tokens["int8"] >= 1.9 * tokens["auto"] and tokens["fp8_e4m3"] >= 1.9 * tokens["auto"]
    # /metrics: the capacity gauge and the dtype label
    metrics = PrometheusMetrics("m")
    engine = SimpleNamespace(on_step=None, on_finished=None, on_step_phases=None, last_token_gaps=[],
                             config=llm.engine.config, stats=s, max_model_len=llm.engine.max_model_len,
                             num_queue_full=0, step_cost=None)
    metrics.attach(engine)
    text = metrics.render()[0].decode()
    assert f'pagedllm:kv_cache_capacity_tokens{{model_name="m"}} {float(tokens["fp8_e4m3"])}' in text
    assert 'cache_dtype="fp8_e4m3"' in text
    for hd in (64, 128):
        bf16 = KVCacheSpec(22, 4, hd, 16, torch.bfloat16)
        assert bf16.bytes_per_token / KVCacheSpec(22, 4, hd, 16, torch.bfloat16, quant=kv_quant("int8")).bytes_per_token >= 1.9


@pytest.mark.skipif(ON_CUDA, reason="the Triton backend keeps a float32 model's cache in float32")
def test_bfloat16_cache_under_a_float32_model(llama_ckpt):
    """kv_cache_dtype bfloat16 under float32 weights: the planes are bfloat16 (2x the tokens of the
    float32 cache in the same memory) while the activations stay float32."""
    tokens, kv_bytes = {}, {}
    for name in ("auto", "bfloat16"):
        llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_dtype=name, kv_cache_memory=4 << 20, max_num_seqs=1024)
        worker = llm.engine.core.executor.worker
        assert worker.kv_cache.dtype == (torch.bfloat16 if name == "bfloat16" else torch.float32)
        assert worker.dtype == torch.float32
        tokens[name] = llm.get_stats().num_total_blocks * 16
        kv_bytes[name] = llm.engine.core.limits().step_cost.kv_bytes_per_token  # the bandwidth metrics' model
    assert tokens["bfloat16"] >= 1.95 * tokens["auto"]
    assert kv_bytes["bfloat16"] * 2 == kv_bytes["auto"]


@pytest.fixture(scope="module")
def reference(llama_ckpt):
    prompts = random_prompts((20, 33, 7, 64), seed=3)
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=8 << 20)
    return prompts, llm.generate(prompt_token_ids=prompts, sampling_params=LOGPROBS, use_tqdm=False)


@pytest.mark.parametrize("name", ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("cpu_kernels", PATHS)
def test_logprobs_close_to_full_precision_cache(monkeypatch, llama_ckpt, reference, name, cpu_kernels):
    prompts, ref = reference
    llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_dtype=name, kv_cache_memory=8 << 20,
              **_engine_kwargs(monkeypatch, cpu_kernels))
    _check_backend(llm)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=LOGPROBS, use_tqdm=False)
    diffs = []
    for a, b in zip(ref, outs):
        ca, cb = a.outputs[0], b.outputs[0]
        for step in range(STEPS):
            la, lb = ca.logprobs[step], cb.logprobs[step]
            for tok in set(la) & set(lb):
                x, y = la[tok].logprob, lb[tok].logprob
                assert math.isfinite(y)
                diffs.append(abs(x - y))
            if ca.token_ids[step] != cb.token_ids[step]:
                break  # later steps see different contexts
    mean_tol, max_tol = TOLERANCE[name]
    assert len(diffs) >= 20 * len(prompts)
    assert sum(diffs) / len(diffs) <= mean_tol and max(diffs) <= max_tol, (sum(diffs) / len(diffs), max(diffs))
    assert max(diffs) > 0  # the cache really holds rounded rows


@pytest.mark.parametrize("name", ["bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("cpu_kernels", PATHS)
def test_prefix_cache_and_preemption_exact(monkeypatch, llama_ckpt, name, cpu_kernels):
    """Warm prefix cache == cold run, forced preemption == none, under the same rounded cache (8-bit,
    or bfloat16 under the float32 model)."""
    shared = random_prompts((96,), seed=9)[0]
    prompts = [shared + p for p in random_prompts((5, 9, 13, 17, 21, 25), seed=10)]
    kw = dict(model=llama_ckpt, dtype="float32", kv_cache_dtype=name, **_engine_kwargs(monkeypatch, cpu_kernels))

    def run(caching, **extra):
        llm = LLM(enable_prefix_caching=caching, **kw, **extra)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                              use_tqdm=False)]
        return outs, llm.get_stats()

    cold, _ = run(False, kv_cache_memory=4 << 20)
    llm = LLM(enable_prefix_caching=True, kv_cache_memory=4 << 20, **kw)
    _check_backend(llm)
    llm.generate(prompt_token_ids=[shared + [7]], sampling_params=GREEDY, use_tqdm=False)  # warms the prefix
    warm = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts]
    assert llm.get_stats().prefix_cache_hits >= 6 * 96 - 16
    assert warm == cold
    # 12 blocks of 16 tokens for six sequences of 20 + 40 tokens: all admitted (2 blocks each), they
    # run out while decoding, and the preempted ones are recomputed
    prompts = random_prompts((20,) * 6, seed=11)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ample = LLM(kv_cache_memory=4 << 20, enable_prefix_caching=False, **kw)
    expected = [o.outputs[0].token_ids for o in ample.generate(prompt_token_ids=prompts, sampling_params=long,
                                                               use_tqdm=False)]
    tight_bytes = KVCacheSpec(2, 2, 16, 16, kv_storage_dtype(name, torch.float32),
                              quant=kv_quant(name)).bytes_per_block * 12
    tight = LLM(kv_cache_memory=tight_bytes, max_model_len=64, enable_prefix_caching=False, **kw)
    got = [o.outputs[0].token_ids for o in tight.generate(prompt_token_ids=prompts, sampling_params=long,
                                                          use_tqdm=False)]
    assert tight.get_stats().num_preemptions > 0
    assert got == expected
