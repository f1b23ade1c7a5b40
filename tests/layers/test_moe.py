"""The MoE layer: routing equals HF's routers (softmax top-k with/without renormalisation,
DeepSeek-V3's grouped sigmoid top-k with correction bias and scaling); grouped experts equal a
dense per-token reference and only run the experts that received tokens."""
import pytest
import torch

from pagedllm.layers.moe import GroupedExperts, RouterConfig, expert_weight_target, select_experts


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing_matches_hf(renormalize):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    cfg = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=renormalize)
    router = Qwen2MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(33, 16)
    _, w_ref, ids_ref = router(x)
    w, ids = select_experts(x @ router.weight.T, RouterConfig(8, 2, "softmax", renormalize))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)


def test_grouped_sigmoid_routing_matches_hf_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(41, 16)
    _, w_ref, ids_ref = router(x)
    rc = RouterConfig(8, 3, "sigmoid", True, num_groups=4, topk_groups=2, scaling_factor=2.5)
    w, ids = select_experts(x @ router.weight.T, rc, router.e_score_correction_bias)
    order, order_ref = ids.sort(dim=-1).indices, ids_ref.sort(dim=-1).indices  # unsorted top-k
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref))
    assert all(len(set((row // 2).tolist())) <= 2 for row in ids)  # within topk_group groups


def test_grouped_experts_match_dense_reference_and_skip_idle_experts(monkeypatch):
    torch.manual_seed(0)
    E, H, I, T, k = 6, 16, 24, 29, 2
    experts = GroupedExperts(E, H, I)
    experts.w13_weight.data.normal_(0, 0.2)
    experts.w2_weight.data.normal_(0, 0.2)
    x = torch.randn(T, H)
    ids = torch.randint(0, 3, (T, k))  # only experts 0..2 receive tokens
    ids[:, 1] = (ids[:, 0] + 1) % 3
    weights = torch.rand(T, k)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            w13 = experts.w13_weight[ids[t, j]]
            h = x[t] @ w13.T
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            ref[t] += weights[t, j] * (a @ experts.w2_weight[ids[t, j]].T)
    calls = []
    import pagedllm.layers.moe as moe

    real = moe.linear
    monkeypatch.setattr(moe, "linear", lambda a, w, b=None: (calls.append(a.shape[0]), real(a, w, b))[1])
    out = experts(x, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * 3 and sum(calls) == 2 * T * k  # 3 active experts, two products each
    monkeypatch.undo()
    if experts.pack_for_cpu(torch.float32):  # the CPU GEMM's packed per-expert weights, stacked freed
        assert experts.w13_weight.numel() == 0
        torch.testing.assert_close(experts(x, weights, ids), ref, rtol=1e-4, atol=1e-4)


def test_expert_names():
    assert expert_weight_target("model.layers.3.mlp.experts.7.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (7, 1))
    assert expert_weight_target("model.layers.3.mlp.experts.7.w2.weight", "w1", "w3", "w2") == (
        "model.layers.3.mlp.experts.w2_weight", (7, 2))
    assert expert_weight_target("model.layers.3.mlp.shared_expert.up_proj.weight") is None
