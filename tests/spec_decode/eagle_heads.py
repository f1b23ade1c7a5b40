"""Tiny EAGLE-1 head checkpoints for tiny Llama targets (tests only): the EAGLE-1 tensor names
(fc, layers.N.*, optional embed_tokens; the first layer without input_layernorm)."""
from __future__ import annotations

import json
import os

import torch


def make_eagle_head(path: str, target: str, *, layers: int = 1, embedding: bool = True, fc_bias: bool = True,
                    fmt: str = "safetensors", prefix: str = "", seed: int = 0, std: float = 0.1,
                    tensors=None) -> str:
    """A random head for ``target`` (its hidden size, heads and vocabulary); ``tensors``: a
    function (dict of tensors) -> None that edits them before saving."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or H // nh
    inter = cfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {"fc.weight": rnd(H, 2 * H)}
    if fc_bias:
        t["fc.bias"] = rnd(H)
    if embedding:
        t["embed_tokens.weight"] = rnd(V, H)
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, H)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, H)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, nh * hd)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, H)
        t[p + "mlp.up_proj.weight"] = rnd(inter, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, inter)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(H)
        if i:
            t[p + "input_layernorm.weight"] = 1 + rnd(H)
    if tensors is not None:
        tensors(t)
    t = {prefix + k: v.contiguous() for k, v in t.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(t, os.path.join(path, "model.safetensors"))
    else:
        torch.save(t, os.path.join(path, "pytorch_model.bin"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return path


def make_bigram_target(path: str, make_ckpt) -> str:
    """A tiny Llama whose layers barely touch the residual stream (o_proj, down_proj ~ 0) and
    whose norms are ones: its greedy next token is argmax(lm_head(embed(current token)))."""
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(path, "model.safetensors")) and os.path.exists(os.path.join(path, ".bigram")):
        return path
    make_ckpt(os.path.basename(path), "llama", seed=5)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    for k in t:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = t[k] * 1e-4
        elif "norm" in k:
            t[k] = torch.ones_like(t[k])
    save_file(t, f, metadata={"format": "pt"})
    open(os.path.join(path, ".bigram"), "w").close()
    return path


def bigram_head_tensors(t: dict) -> None:
    """fc passes the token embedding through, the layer adds nothing: the head proposes
    argmax(lm_head(embed(token))), what a bigram target predicts."""
    H = t["fc.weight"].shape[0]
    t["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    t.pop("fc.bias", None)
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = torch.zeros_like(t[k])
