"""vLLM's ``estimated_flops_per_gpu`` / ``estimated_read_bytes_per_gpu`` /
``estimated_write_bytes_per_gpu`` counters: a performance model of each engine step, per rank.

The model (``StepCostModel``, built once from the checkpoint's config and what the core loaded)
turns the scheduler's cumulative counters (SchedulerStats) into figures, so a step costs the
scheduler a few integer additions and the metrics a few multiplications:

- FLOPs: 2 x the matmul parameters a token runs through (attention projections, the MLP or the
  experts a token is routed to, the router; not the embedding) per token computed; 2 x hidden x
  vocab (the LM head) per request row of a step; and attention, 4 x layers x heads x head_dim per
  (query token, context token) pair (a query at position p attends p + 1 tokens: full attention
  is assumed, a sliding window attends less).
- Read bytes: the rank's weights once per step that ran the model (an upper bound: an untied
  input embedding is only gathered, experts no token picked are skipped), and the KV cache of
  every row's context and new tokens once per step.
- Written bytes: the KV cache of the tokens computed.

Everything is divided over the ranks (tensor x pipeline parallel); the weights are the ranks'
mean. Activations and the vision encoder are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import attention_heads, hf_field

# decoders whose MLP is up + down (no gate projection)
_UNGATED_MLP = ("gpt2", "gpt_bigcode", "gpt_neox", "falcon", "phi", "starcoder2")


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Per rank: FLOPs per token computed, per request row (LM head), per attention pair; the
    bytes of weights read per step and of KV cache per token."""

    flops_per_token: int
    flops_per_row: int
    flops_per_pair: int
    weight_bytes: int
    kv_bytes_per_token: int

    def totals(self, stats) -> tuple[int, int, int]:
        """(FLOPs, bytes read, bytes written) since start, from a SchedulerStats snapshot."""
        tokens = stats.num_scheduled_tokens_total
        flops = (self.flops_per_token * tokens + self.flops_per_row * stats.num_scheduled_rows_total
                 + self.flops_per_pair * stats.num_attention_pairs_total)
        read = self.weight_bytes * stats.num_steps + self.kv_bytes_per_token * stats.num_context_tokens_total
        return flops, read, self.kv_bytes_per_token * tokens


def _mlp_params(hf_config, hidden: int) -> tuple[int, int]:
    """(dense MLP parameters of one layer, parameters a token runs through in an MoE layer)."""
    inter = (hf_field(hf_config, "intermediate_size") or hf_field(hf_config, "n_inner")
             or hf_field(hf_config, "ffn_hidden_size") or 4 * hidden)
    mats = 2 if hf_field(hf_config, "model_type") in _UNGATED_MLP else 3
    dense = mats * hidden * inter
    experts = (hf_field(hf_config, "num_local_experts") or hf_field(hf_config, "num_experts")
               or hf_field(hf_config, "n_routed_experts") or 0)
    if not experts:
        return dense, dense
    top_k = hf_field(hf_config, "num_experts_per_tok") or 1
    expert_inter = hf_field(hf_config, "moe_intermediate_size") or inter
    shared = (hf_field(hf_config, "shared_expert_intermediate_size")
              or (hf_field(hf_config, "n_shared_experts") or 0) * expert_inter)
    return dense, 3 * hidden * (top_k * expert_inter + shared) + hidden * experts


def step_cost_model(hf_config, world_size: int, weight_bytes_per_rank, kv_element_bytes: int,
                    kv_scale_bytes: int = 0) -> StepCostModel:
    """``kv_element_bytes``: one KV cache value; ``kv_scale_bytes``: an 8-bit cache's scale per
    (token, kv head, plane), else 0."""
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads, kv_heads, head_dim = attention_heads(hf_config)
    latent = hf_field(hf_config, "kv_lora_rank")
    if latent:  # multi-head latent attention (DeepSeek): one cached vector per token and layer
        nope, rope = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        v_dim, q_rank = hf_config.v_head_dim, hf_field(hf_config, "q_lora_rank")
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (latent + rope) + latent * heads * (nope + v_dim) + heads * v_dim * hidden
        pair = 2 * heads * (nope + rope + v_dim)
        kv_token = latent + rope, 1
    else:
        attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        pair = 4 * heads * head_dim
        kv_token = head_dim, kv_heads * 2
    dense, moe = _mlp_params(hf_config, hidden)
    dense_layers = min(layers, hf_field(hf_config, "first_k_dense_replace") or 0)
    params = layers * attn + dense_layers * dense + (layers - dense_layers) * moe
    vocab = hf_config.vocab_size
    width, vectors = kv_token
    kv_bytes = layers * vectors * (width * kv_element_bytes + kv_scale_bytes)
    world = max(1, world_size)
    weights = list(weight_bytes_per_rank) or [0]
    return StepCostModel(flops_per_token=2 * params // world, flops_per_row=2 * hidden * vocab // world,
                         flops_per_pair=layers * pair // world, weight_bytes=sum(weights) // len(weights),
                         kv_bytes_per_token=kv_bytes // world)
