"""config.json read without transformers gives the values transformers' config classes give for
every attribute pagedllm reads (and the real rope_theta where transformers 5 only keeps
``rope_parameters``)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm.models.config_json import load_config_json

ATTRS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
         "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias", "eos_token_id", "bos_token_id")


# what pagedllm's model code assumes when transformers' config object lacks the attribute
_READ_DEFAULTS = {"attention_bias": False, "mlp_bias": False}


def same(hf, light, attr) -> bool:
    if attr == "head_dim":
        return (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads) == light.head_dim
    d = _READ_DEFAULTS.get(attr)
    return getattr(hf, attr, d) == getattr(light, attr, d)


def _hf(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_matches_autoconfig(make_ckpt, arch):
    path = make_ckpt(f"cfg_{arch}", arch, tie=arch == "qwen2")
    hf, light = _hf(path), load_config_json(path)
    assert light is not None
    for attr in ATTRS:
        assert same(hf, light, attr), attr
    for attr in ("sliding_window", "use_sliding_window", "layer_types"):
        assert same(hf, light, attr), attr
    rope = getattr(hf, "rope_parameters", None) or {}
    assert light.rope_theta == rope.get("rope_theta", getattr(hf, "rope_theta", None))


def test_rope_theta_from_rope_parameters(make_ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(make_ckpt("cfg_llama", "llama"), path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    light = load_config_json(path)
    assert light.rope_theta == 500000.0 and light.rope_scaling["rope_type"] == "default"


def test_defaults_for_missing_keys_and_fallback(make_ckpt, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(make_ckpt("cfg_llama", "llama"), path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    for key in ("head_dim", "num_key_value_heads", "rms_norm_eps", "attention_bias", "mlp_bias"):
        cfg.pop(key, None)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    hf, light = _hf(path), load_config_json(path)
    for attr in ATTRS:
        assert same(hf, light, attr), attr
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    assert load_config_json(path) is None  # transformers decides (and pagedllm reports it unsupported)


def test_default_model(default_model):
    hf, light = _hf(default_model), load_config_json(default_model)
    for attr in ATTRS:
        assert same(hf, light, attr), attr
