"""Architecture name (config.architectures) -> model class."""
from __future__ import annotations

from pagedllm.models.cohere import CohereForCausalLM
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gpt2 import GPT2LMHeadModel
from pagedllm.models.falcon import FalconForCausalLM
from pagedllm.models.gpt_bigcode import GPTBigCodeForCausalLM
from pagedllm.models.gpt_neox import GPTNeoXForCausalLM
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM
from pagedllm.models.llava import LlavaForConditionalGeneration
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmo2 import Olmo2ForCausalLM
from pagedllm.models.phi import PhiForCausalLM
from pagedllm.models.stablelm import StableLmForCausalLM
from pagedllm.models.starcoder2 import Starcoder2ForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # images in the prompt (pagedllm/multimodal)
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
