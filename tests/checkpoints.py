"""Tiny random-weight HF checkpoints built locally (there is no model hub)."""
from __future__ import annotations

import json
import os

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _tokenizer_files(path: str, vocab_size: int) -> None:
    """A small word-level tokenizer over the checkpoint's vocab (ids < vocab_size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    fast.save_pretrained(path)


def make_checkpoint(path: str, arch: str = "llama", *, vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128, max_pos: int = 1024,
                    tie: bool = False, seed: int = 0, init_std: float = 0.1, rope_scaling=None, rope_theta=10000.0,
                    dtype=torch.float32, shards: int = 1, head_dim=None, sliding_window=None, extra=None) -> str:
    import transformers as tf

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, initializer_range=init_std, bos_token_id=1, eos_token_id=2,
                  rms_norm_eps=1e-6, rope_theta=rope_theta)
    if arch == "llama":
        cfg = tf.LlamaConfig(rope_scaling=rope_scaling, **common)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(sliding_window=sliding_window, **common)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(head_dim=head_dim or hidden // heads, **common)
        cls = tf.Qwen3ForCausalLM
    elif arch in MOE_ARCHS:  # extra: the family's MoE / MLA config fields
        cfg_cls, cls = (getattr(tf, n) for n in MOE_ARCHS[arch])
        cfg = cfg_cls(**common, **(extra or {}))
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # make biases / norms non-trivial so bugs show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing: a bias that matters
                b.add_(torch.randn_like(b) * 0.1)
    kw = {}
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        kw["max_shard_size"] = max(total // shards, 1)
    model.save_pretrained(path, safe_serialization=True, **kw)
    _tokenizer_files(path, vocab_size)
    return path


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    m.eval()
    return m


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    return greedy_continuations(hf_model(path), prompts, max_new_tokens)


def greedy_continuations(m, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """An HF model's greedy continuations of exactly ``max_new_tokens`` (EOS ignored)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
            outs.append(g[0, len(p):].tolist())
    return outs


NEAR_TIE = 0.02


def assert_greedy_agrees(outputs, reference, min_compared: float = 0.5) -> None:
    """Greedy tokens equal the reference wherever the choice is clear. A divergence is accepted
    only at a near-tie (top-1 minus top-2 logprob < NEAR_TIE, from ``logprobs=2``), after which
    that sequence is not compared further (low-precision runs legitimately split there). At
    least ``min_compared`` of all tokens must have been compared, so the check cannot pass by
    diverging early everywhere."""
    compared = total = 0
    for out, ref in zip(outputs, reference):
        got = out.outputs[0].token_ids
        total += len(ref)
        for i, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                top = sorted(out.outputs[0].logprobs[i].values(), key=lambda lp: -lp.logprob)
                margin = top[0].logprob - top[1].logprob
                assert margin < NEAR_TIE, f"token {i}: {a} vs reference {b} with a clear margin {margin:.4f}"
                break
            compared += 1
    assert compared >= min_compared * total, f"only {compared} of {total} tokens compared before near-ties"
