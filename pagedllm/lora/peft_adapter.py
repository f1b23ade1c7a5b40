"""A LoRA adapter as PEFT saves it, read and checked against the base model's shapes.

A directory holds ``adapter_config.json`` (r, lora_alpha, use_rslora, target_modules, ...) and
``adapter_model.safetensors`` with keys such as
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). The delta of a target is ``x @ A.T @ B.T * scaling`` with scaling ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA).

Everything an adapter could get wrong is refused here, with the reason, before it reaches a
slot: missing files, a rank above ``max_lora_rank``, targets other than the attention and MLP
projections, shapes that do not fit the base model, and PEFT features the batched deltas do not
compute (modules_to_save, DoRA, bias, per-module rank/alpha patterns).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.config import attention_heads, hf_field

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# Llama-layout families: q/k/v fused into qkv_proj, gate/up into gate_up_proj by the model code.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class ModelLoRALayout:
    """What an adapter must fit: the layer count and each target's (in, out) features."""

    model_type: str
    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @staticmethod
    def from_hf_config(hf_config) -> "ModelLoRALayout":
        model_type = hf_field(hf_config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"LoRA adapters are supported on {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints; this "
                             f"model is {model_type!r}")
        hidden = hf_config.hidden_size
        heads, kv_heads, head_dim = attention_heads(hf_config)
        inter = hf_config.intermediate_size
        shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
                  "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return ModelLoRALayout(model_type, hf_config.num_hidden_layers, shapes)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    targets: tuple[str, ...]


@dataclass
class AdapterWeights:
    """Full (unsharded) A [r, in] and B [out, r] per (layer, target), on the CPU; B already
    multiplied by the scaling."""

    config: AdapterConfig
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())


def _files(path: str) -> tuple[str, str]:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory (expected PEFT's {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg, weights = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(weights):
        other = " (only adapter_model.bin: save it with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}{other}")
    return cfg, weights


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    cfg_file, _ = _files(path)
    try:
        with open(cfg_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not readable JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} nests too deeply to be read") from None
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    where = f"LoRA adapter {path!r}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"{where}: rank r={r} is above max_lora_rank={max_lora_rank} (start the engine with "
                         f"max_lora_rank >= {r})")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    if raw.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {raw['modules_to_save']!r} is not supported (fully trained "
                         "copies of modules cannot be served beside the shared base weights)")
    for name, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if raw.get(name):
            raise ValueError(f"{where}: {name} ({what}) is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={raw['bias']!r} is not supported (only 'none')")
    for name in ("rank_pattern", "alpha_pattern"):
        if raw.get(name):
            raise ValueError(f"{where}: {name} (a rank or alpha per module) is not supported")
    if raw.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out is not supported (Conv1D-style weights)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in TARGETS else None  # a regex: the weights say what is targeted
    if targets is not None:
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"{where}: target modules {unknown} are not supported (supported: {', '.join(TARGETS)})")
    scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    return AdapterConfig(rank=r, scaling=float(scaling), targets=tuple(targets or ()))


def load_adapter(path: str, layout: ModelLoRALayout, max_lora_rank: int,
                 dtype: Optional[torch.dtype] = None) -> AdapterWeights:
    """Read and check the adapter at ``path``; ValueError naming the problem otherwise."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_lora_rank)
    _, weights_file = _files(path)
    where = f"LoRA adapter {path!r}"
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_file, framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise ValueError(f"{where}: weight {key!r} is not a LoRA A/B matrix of a decoder layer's "
                                     f"projection (supported targets: {', '.join(TARGETS)})")
                layer, target, ab = int(m.group(1)), m.group(3), m.group(4)
                if target not in TARGETS:
                    raise ValueError(f"{where}: target module {target!r} is not supported (supported: "
                                     f"{', '.join(TARGETS)})")
                if layer >= layout.num_layers:
                    raise ValueError(f"{where}: weight {key!r} is for layer {layer}, but the model has "
                                     f"{layout.num_layers} layers")
                parts.setdefault((layer, target), {})[ab] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # a corrupt file
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not readable: {e}") from None
    if not parts:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {target} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = layout.shapes[target]
        if tuple(a.shape) != (config.rank, fan_in) or tuple(b.shape) != (fan_out, config.rank):
            raise ValueError(f"{where}: layer {layer} {target} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; the base model needs ({config.rank}, {fan_in}) and "
                             f"({fan_out}, {config.rank}) for rank {config.rank}")
        out_dtype = dtype or a.dtype
        a, b = a.to(out_dtype).contiguous(), (b.float() * config.scaling).to(out_dtype).contiguous()
        for name, t in (("lora_A", a), ("lora_B x scaling", b)):  # NaN/inf would silently spoil every output
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}: layer {layer} {target} {name} holds non-finite values (NaN or inf) "
                                 f"in {out_dtype}")
        tensors[(layer, target)] = (a, b)
    found = tuple(sorted({t for _, t in tensors}, key=TARGETS.index))
    if config.targets and not set(found) <= set(config.targets):
        raise ValueError(f"{where}: weights target {list(found)} but target_modules is {list(config.targets)}")
    return AdapterWeights(AdapterConfig(config.rank, config.scaling, found), tensors)


def adapter_digest(path: str) -> str:
    """sha256 of the adapter's config and weights files (hex, 16 characters): the adapter's identity
    beside its name, so the prefix cache never reuses one adapter's KV for another's."""
    h = hashlib.sha256()
    for name in _files(path):
        h.update(os.path.basename(name).encode() + b"\x00")
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]
