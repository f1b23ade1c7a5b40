"""Read a checkpoint's config.json without importing transformers (which takes seconds: it pulls
in torch.distributed.tensor and sympy just to define LlamaConfig).

Only for the architectures pagedllm runs; anything else returns None and the caller falls back
to ``transformers.AutoConfig``. Missing keys get the transformers class defaults of the
attributes pagedllm reads; ``rope_theta`` / ``rope_scaling`` are also taken from the newer
``rope_parameters`` spelling.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

_COMMON = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_scaling=None, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=None,
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(_COMMON),
    "MistralForCausalLM": dict(_COMMON, intermediate_size=14336, num_key_value_heads=8,
                               max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, sliding_window=4096),
    "Qwen2ForCausalLM": dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                             rope_theta=10000.0, use_sliding_window=False, sliding_window=4096,
                             bos_token_id=None, eos_token_id=None),
    "Qwen3ForCausalLM": dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                             head_dim=128, rope_theta=10000.0, use_sliding_window=False, sliding_window=4096,
                             bos_token_id=None, eos_token_id=None),
}


# LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a projector and one of the text
# families above. Its config is read flat: the text model's fields at the top (what the engine,
# the worker and the layers read), the vision tower's under ``vision_config``.
_CLIP_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
_LLAVA = dict(image_token_index=32000, projector_hidden_act="gelu", vision_feature_select_strategy="default",
              vision_feature_layer=-2, multimodal_projector_bias=True)
_TEXT_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}
MULTIMODAL_TEXT_ARCHS = tuple(_TEXT_ARCH.values())


def _llava_values(raw: dict[str, Any]) -> Optional[dict[str, Any]]:
    text = dict(raw.get("text_config") or {"model_type": "llama"})
    text_arch = (text.get("architectures") or [None])[0] or _TEXT_ARCH.get(text.get("model_type", "llama"))
    if text_arch not in MULTIMODAL_TEXT_ARCHS:
        raise ValueError(f"LLaVA with a {text_arch or text.get('model_type')!r} language model is not supported "
                         f"(supported: {', '.join(MULTIMODAL_TEXT_ARCHS)})")
    vision = dict(_CLIP_VISION)
    vision.update(raw.get("vision_config") or {})
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision['model_type']!r} vision tower is not supported (supported: "
                         "clip_vision_model)")
    values = {k: raw.get(k, v) for k, v in _LLAVA.items()}
    if "image_token_id" in raw and "image_token_index" not in raw:
        values["image_token_index"] = raw["image_token_id"]
    text.pop("architectures", None)
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key in raw and key not in text:
            text[key] = raw[key]
    text.update(values, architectures=[raw["architectures"][0]], text_architecture=text_arch,
                vision_config=JsonConfig(vision))
    return _with_defaults(text_arch, text)


class JsonConfig:
    """Attribute access over config.json plus defaults (picklable, for worker processes)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str):  # only called for missing attributes
        raise AttributeError(f"config has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"JsonConfig({self.__dict__!r})"


def load_config_json(model_dir: str) -> Optional[JsonConfig]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    archs = raw.get("architectures") or [] if isinstance(raw, dict) else []
    if archs == ["LlavaForConditionalGeneration"] and not raw.get("quantization_config"):
        return JsonConfig(_llava_values(raw))
    if not isinstance(raw, dict) or len(archs) != 1 or archs[0] not in _DEFAULTS:
        return None
    if raw.get("quantization_config") or raw.get("text_config"):
        return None
    return JsonConfig(_with_defaults(archs[0], raw))


def _with_defaults(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    values = dict(_DEFAULTS[arch])
    values.update(raw)
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        if "rope_theta" not in raw and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if raw.get("rope_scaling") is None:
            values["rope_scaling"] = rope
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("use_sliding_window") is False:
        values["sliding_window"] = None
    if "torch_dtype" not in raw and "dtype" in raw:
        values["torch_dtype"] = raw["dtype"]
    return values


def load_hf_config(model_dir: str):
    """The checkpoint's config: the light reader above for supported architectures (no
    transformers import, which takes seconds), else ``transformers.AutoConfig``. A GGUF file's
    config is read from its converted metadata (models/gguf.py)."""
    from pagedllm.models.gguf import metadata_dir

    model_dir = metadata_dir(model_dir)
    light = load_config_json(model_dir)
    if light is not None:
        return light
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ValueError(f"could not read a model config from {model_dir!r}: {e}") from e


# Sampling fields a generation_config.json may recommend (vLLM reads the same ones).
GENERATION_DEFAULT_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def load_generation_defaults(model_dir: str, source: str = "auto") -> dict[str, Any]:
    """The model's recommended sampling defaults as SamplingParams keyword arguments
    (``max_new_tokens`` becomes ``max_tokens``): from ``model_dir/generation_config.json`` when
    ``source`` is "auto", from ``source/generation_config.json`` when it names a directory, none
    for "vllm". Values that SamplingParams refuses are an error naming the file and field."""
    if source == "vllm":
        return {}
    path = os.path.join(model_dir if source == "auto" else source, "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    out = {k: data[k] for k in GENERATION_DEFAULT_KEYS if data.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    from pagedllm.sampling_params import SamplingParams

    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e} (--generation-config vllm ignores the file)") from None
    return out
