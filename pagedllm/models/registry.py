"""Architecture name (config.architectures) -> model class."""
from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_model_class(hf_config):
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none in config.json)'}; "
        f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )
