"""Tiny random-weight checkpoints of the dense families beyond Llama (Gemma 2/3, Phi-3, OLMo 2,
GPT-2, GPT-NeoX, Falcon's three layouts, Phi, StableLM, Starcoder2, GPTBigCode, Granite, Cohere),
built locally with transformers' config classes, weights widened so differences show."""
from __future__ import annotations

import os

import torch

from checkpoints import _tokenizer_files

WINDOW = 16  # sliding window of the families that have one: shorter than most test prompts
VOCAB = 512


def _config(family: str, layers: int):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gemma2":
        return tf.Gemma2Config(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               attn_logit_softcapping=1.5, final_logit_softcapping=4.0, **common), tf.Gemma2ForCausalLM
    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=types,
                                   rope_parameters=rope, **common), tf.Gemma3ForCausalLM
    if family == "phi3":
        # LongRoPE: prompts + outputs stay below original_max_position_embeddings (short factors)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 512}
        common = dict(common, max_position_embeddings=2048)
        return tf.Phi3Config(rope_parameters=rope, original_max_position_embeddings=512, sliding_window=WINDOW,
                             **common), tf.Phi3ForCausalLM
    if family == "olmo2":
        return tf.Olmo2Config(**common), tf.Olmo2ForCausalLM
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=1024,
                             bos_token_id=1, eos_token_id=2), tf.GPT2LMHeadModel
    return _gpt_style_config(tf, family, layers, common)


def _rope(partial: float = 1.0) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


def _gpt_style_config(tf, family: str, layers: int, common: dict):
    """The families of issue 34, each with the options its real checkpoints use switched on."""
    base = {k: common[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")}
    if family == "gpt_neox":  # Pythia: parallel residual, a quarter... here half of each head rotated
        return tf.GPTNeoXConfig(intermediate_size=128, rope_parameters=_rope(0.5), **base), tf.GPTNeoXForCausalLM
    if family == "falcon":  # Falcon-40B/180B: new decoder architecture, grouped kv heads, two norms
        return tf.FalconConfig(new_decoder_architecture=True, num_kv_heads=2, bias=False, ffn_hidden_size=128,
                               **base), tf.FalconForCausalLM
    if family == "falcon_mqa":  # Falcon-7B: multi-query, parallel attention + MLP, one norm (+ biases)
        return tf.FalconConfig(multi_query=True, parallel_attn=True, bias=True, ffn_hidden_size=128,
                               **base), tf.FalconForCausalLM
    if family == "falcon_alibi":  # Falcon-RW: ALiBi, per-head fused qkv, sequential
        return tf.FalconConfig(alibi=True, multi_query=False, parallel_attn=False, bias=False, ffn_hidden_size=128,
                               **base), tf.FalconForCausalLM
    if family == "phi":  # phi-2: partial rotary, parallel attention + MLP, biased everywhere incl. the LM head
        return tf.PhiConfig(intermediate_size=128, num_key_value_heads=2, rope_parameters=_rope(0.5),
                            **base), tf.PhiForCausalLM
    if family == "stablelm":  # StableLM-2: partial rotary, qkv bias, per-head q/k LayerNorms, sequential
        return tf.StableLmConfig(intermediate_size=128, num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True,
                                 rope_parameters=_rope(0.25), **base), tf.StableLmForCausalLM
    if family == "starcoder2":  # biased projections, plain GELU MLP, LayerNorm, sliding window
        return tf.Starcoder2Config(intermediate_size=128, num_key_value_heads=2, sliding_window=WINDOW,
                                   **base), tf.Starcoder2ForCausalLM
    if family == "gpt_bigcode":  # StarCoder / SantaCoder: multi-query, learned positions
        return tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=1024,
                                   multi_query=True, bos_token_id=1, eos_token_id=2), tf.GPTBigCodeForCausalLM
    if family == "granite":
        return tf.GraniteConfig(intermediate_size=128, num_key_value_heads=2, embedding_multiplier=3.0,
                                residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
                                **base), tf.GraniteForCausalLM
    if family == "cohere":  # Command-R: parallel block, LayerNorm without bias, interleaved rotary, logit scale
        return tf.CohereConfig(intermediate_size=128, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5,
                               **base), tf.CohereForCausalLM
    raise ValueError(family)


def make_dense_checkpoint(path: str, family: str, *, layers: int = 2, seed: int = 0, init_std: float = 0.1) -> str:
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg, cls = _config(family, layers)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():  # non-trivial norms and biases so bugs show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer_files(path, VOCAB)
    return path
