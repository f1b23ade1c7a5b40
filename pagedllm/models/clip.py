"""CLIP's vision transformer (the image encoder of LLaVA), over plain torch: patch embedding (a
strided convolution) + class token + learned positions, a pre-norm, then pre-norm encoder layers
(bidirectional multi-head attention, an MLP). Images are encoded once per request (no KV cache:
worker/encoder_cache.py keeps the outputs until the prompt's positions are computed).

Only the layers the feature layer needs are built (LLaVA reads the second-to-last layer's hidden
states: the last layer and the final norm are never run, and their checkpoint tensors are skipped).
Parameter names are HF's (``vision_model.embeddings.patch_embedding.weight``, ...)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        approximate = "none" if name == "gelu" else "tanh"
        return lambda x: F.gelu(x, approximate=approximate)
    raise ValueError(f"unsupported vision hidden_act {name!r} (supported: quick_gelu, gelu, gelu_pytorch_tanh)")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, self.patch_size, self.image_size = config.hidden_size, config.patch_size, config.image_size
        self.class_embedding = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, self.patch_size, self.patch_size, bias=False)
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"image of {h}x{w} pixels, the vision tower takes {self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, s, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, s, d))


class CLIPMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(config) for _ in range(num_layers)])


class CLIPVisionTransformer(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # (sic: HF's name)
        self.encoder = CLIPEncoder(config, num_layers)


class CLIPVisionTower(nn.Module):
    """``feature_layers``: indices into HF's hidden states (0: the embeddings after the pre-norm,
    i: after layer i; negative from the end, -1 being the last layer) whose outputs are returned,
    concatenated along the features."""

    def __init__(self, config, feature_layers: list[int]) -> None:
        super().__init__()
        total = config.num_hidden_layers
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in feature_layers]
        if any(not 0 <= i <= total for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {total} layers")
        self.num_layers = max(self.feature_layers)  # layers after the deepest feature layer never run
        self.vision_model = CLIPVisionTransformer(config, self.num_layers)

    def skips(self, name: str) -> bool:
        """A checkpoint tensor of a part this tower never runs (later layers, the final norm)."""
        if name.startswith("vision_model.post_layernorm."):
            return True
        prefix = "vision_model.encoder.layers."
        return name.startswith(prefix) and int(name[len(prefix):].split(".", 1)[0]) >= self.num_layers

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, 1 + patches, hidden x len(feature_layers)]."""
        vm = self.vision_model
        h = vm.pre_layrnorm(vm.embeddings(pixel_values))
        picked = [h] if 0 in self.feature_layers else []
        for i, layer in enumerate(vm.encoder.layers, start=1):
            h = layer(h)
            if i in self.feature_layers:
                picked.append(h)
        order = sorted(self.feature_layers)  # hidden states were collected in depth order
        return torch.cat([picked[order.index(i)] for i in self.feature_layers], dim=-1)
