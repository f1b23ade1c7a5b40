"""The step performance model behind vLLM's estimated_*_per_gpu counters (metrics/perf_model.py):
its coefficients against a real checkpoint's matmul weights and KV cache, the scheduler's counters
for a known request, and the counters /metrics exports for it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoints import hf_model
from pagedllm.metrics.perf_model import step_cost_model
from pagedllm.sampling_params import SamplingParams

P, G = 10, 4  # prompt tokens, generated tokens


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("perf_llama", "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)


def matmul_params(path: str) -> int:
    """Weights of the linear layers a token runs through (the LM head aside)."""
    m = hf_model(path)
    return sum(mod.weight.numel() for name, mod in m.named_modules()
               if isinstance(mod, torch.nn.Linear) and name != "lm_head")


def test_coefficients_follow_the_checkpoint(ckpt):
    from pagedllm.models.config_json import load_hf_config

    hf = load_hf_config(ckpt)
    cost = step_cost_model(hf, 1, [1000], kv_element_bytes=4)
    assert cost.flops_per_token == 2 * matmul_params(ckpt)
    assert cost.flops_per_row == 2 * 64 * hf.vocab_size
    assert cost.flops_per_pair == 2 * 4 * 4 * 16  # layers x 4 x heads x head_dim
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert cost.weight_bytes == 1000
    int8 = step_cost_model(hf, 1, [1000], kv_element_bytes=1, kv_scale_bytes=2)
    assert int8.kv_bytes_per_token == 2 * 2 * 2 * (16 * 1 + 2)  # a bf16 scale per token, kv head and plane
    tp2 = step_cost_model(hf, 2, [600, 400], kv_element_bytes=4)  # per rank: halves, the weights' mean
    assert (tp2.flops_per_token, tp2.kv_bytes_per_token, tp2.weight_bytes) == \
        (cost.flops_per_token // 2, cost.kv_bytes_per_token // 2, 500)


def test_a_known_request_adds_the_formula(ckpt):
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.metrics.prometheus import PrometheusMetrics

    llm = LLM(model=ckpt, dtype="float32", enable_prefix_caching=False, kv_cache_memory=4 << 20)
    try:
        cost = llm.engine.client.limits.step_cost
        weights = llm.engine.core.executor.weight_bytes_per_rank
        before = llm.get_stats()
        llm.generate(prompt_token_ids=[list(range(5, 5 + P))],
                     sampling_params=SamplingParams(max_tokens=G, ignore_eos=True, temperature=0), use_tqdm=False)
        after = llm.get_stats()
    finally:
        llm.shutdown()
    assert cost == step_cost_model(llm.engine.hf_config, 1, weights, kv_element_bytes=4)
    # one prefill step of P tokens (query i attends i + 1), then G - 1 decode steps at context P .. P + G - 2
    tokens, rows = P + G - 1, G
    pairs = P * (P + 1) // 2 + sum(c + 1 for c in range(P, P + G - 1))
    context = P + sum(c + 1 for c in range(P, P + G - 1))
    d = {name: getattr(after, name) - getattr(before, name) for name in
         ("num_scheduled_tokens_total", "num_scheduled_rows_total", "num_attention_pairs_total",
          "num_context_tokens_total", "num_steps")}
    assert d == {"num_scheduled_tokens_total": tokens, "num_scheduled_rows_total": rows,
                 "num_attention_pairs_total": pairs, "num_context_tokens_total": context, "num_steps": G}
    metrics = PrometheusMetrics("m")
    engine = SimpleNamespace(on_step=None, on_finished=None, on_step_phases=None, last_token_gaps=[],
                             config=llm.engine.config, stats=before, max_model_len=llm.engine.max_model_len,
                             num_queue_full=0, step_cost=cost)  # what attach reads from an AsyncLLM
    metrics.attach(engine)
    base = metrics.render()[0].decode()
    metrics.update_stats(after)
    text = metrics.render()[0].decode()

    def grew(name):
        line = f'pagedllm:estimated_{name}_per_gpu_total{{engine="0",model_name="m"}} '

        def value(t):
            return float(next(ln for ln in t.splitlines() if ln.startswith(line)).split()[-1])
        return value(text) - value(base)

    assert grew("flops") == cost.flops_per_token * tokens + cost.flops_per_row * rows + cost.flops_per_pair * pairs
    assert grew("read_bytes") == sum(weights) * G + cost.kv_bytes_per_token * context
    assert grew("write_bytes") == cost.kv_bytes_per_token * tokens


def test_latent_attention_and_experts():
    """DeepSeek-shaped: latent attention's one cached vector a token, routed and shared experts,
    the first dense layers."""
    hf = SimpleNamespace(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=100, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                         q_lora_rank=None, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, model_type="deepseek_v3")
    cost = step_cost_model(hf, 1, [0], kv_element_bytes=2)
    attn = 32 * 2 * 6 + 32 * (8 + 2) + 8 * 2 * (4 + 4) + 2 * 4 * 32
    dense, moe = 3 * 32 * 64, 3 * 32 * (2 * 16 + 16) + 32 * 4
    assert cost.flops_per_token == 2 * (3 * attn + dense + 2 * moe)
    assert cost.kv_bytes_per_token == 3 * (8 + 2) * 2
    assert cost.flops_per_pair == 3 * 2 * 2 * (6 + 4)
