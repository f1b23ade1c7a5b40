"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower (models/clip.py), a two-layer
projector into the language model's hidden size, and a Llama-family language model (Llama,
Mistral, Qwen2, Qwen3: models/llama.py), all ours over the paged attention backends.

A prompt's image placeholders were expanded by the front end (multimodal/processor.py) to one
position per image feature; the runner encodes the images of a step's prefill chunk
(``embed_images``) and hands the rows that fall in this chunk to ``forward`` as ``mm_embeds``
(flat token indices, features), which replace those positions' token embeddings. Decode steps
run exactly as the text model's.

Checkpoints name the parts in any of the layouts transformers wrote: ``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.*``, or
``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
``multi_modal_projector.*``; the tower's tensors with or without its ``vision_model.`` level
(llava-hf's checkpoints have it, transformers 5.24 saves without it). The config is read flat (models/config_json.py): the text model's
fields at the top, the tower's under ``vision_config``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.clip import CLIPVisionTower
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.pipeline import stage_module

_PREFIXES = (  # checkpoint prefix -> ours
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"unsupported projector_hidden_act {act!r} (supported: gelu, gelu_pytorch_tanh)")
        self.approximate = "none" if act == "gelu" else "tanh"
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate=self.approximate))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    supports_multimodal = True  # the runner keeps an encoder cache (worker/encoder_cache.py)
    supports_pp = True  # the tower and projector live on the first stage, with the embedding

    def __init__(self, config) -> None:
        text_arch = getattr(config, "text_architecture", "LlamaForCausalLM")
        self.qkv_bias = text_arch == "Qwen2ForCausalLM" or (text_arch == "Qwen3ForCausalLM"
                                                           and bool(getattr(config, "attention_bias", False)))
        self.qk_norm = text_arch == "Qwen3ForCausalLM"
        super().__init__(config)
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        first = self.model.is_first  # pipeline parallel: images are embedded on the first stage only
        self.vision_tower = stage_module(first, lambda: CLIPVisionTower(config.vision_config, layers))
        self.drop_cls = config.vision_feature_select_strategy == "default"
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        self.multi_modal_projector = stage_module(first, lambda: LlavaProjector(
            config.vision_config.hidden_size * len(layers), config.hidden_size, config.projector_hidden_act,
            config.multimodal_projector_bias))
        self.supports_multimodal = first  # later stages get the first stage's hidden states, not images

    # ---- weights -------------------------------------------------------------------------------
    def checkpoint_tensors(self, weights):
        """Checkpoint names -> ours; tensors of tower parts never run are dropped."""
        for name, tensor in weights:
            for old, new in _PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + name[len("vision_tower."):]  # transformers 5 drops the level
            if (name.startswith("vision_tower.") and self.supports_multimodal
                    and self.vision_tower.skips(name[len("vision_tower."):])):
                continue
            yield name, tensor

    def remap_checkpoint_name(self, name: str):
        """The tower's and the projector's tensors load as they are (their q/k/v stay apart)."""
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return name, None
        return None

    # ---- forward -------------------------------------------------------------------------------
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, positions per image, hidden]: what fills each image's placeholders."""
        features = self.vision_tower(pixel_values)
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None,
                mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """``mm_embeds``: (flat indices [K], features [K, hidden]) of this step's image positions."""
        if mm_embeds is None or not self.model.is_first:
            return self.model(input_ids, positions, intermediate)
        embeds = self.model.embed_tokens(input_ids)
        index, features = mm_embeds
        embeds = embeds.index_copy(0, index, features.to(embeds.dtype))
        return self.model(input_ids, positions, intermediate, inputs_embeds=embeds)
