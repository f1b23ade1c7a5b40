"""Safetensors weight loading (single file or sharded index), local paths only.

Each checkpoint tensor is routed to the parameter that owns it; fused parameters receive it
through their ``weight_loader`` with a shard id. Tensors are read one at a time (no full copy
of the checkpoint in memory).
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.layers.linear import default_weight_loader


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"cannot read the weights index {index}: {type(e).__name__}: {e}") from None
        return [os.path.join(model_dir, name) for name in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


class SliceSource:
    """A checkpoint tensor not read yet: loaders narrow it first, so a tensor-parallel rank reads
    only its own shard from disk."""

    def __init__(self, sl) -> None:
        self._slice = sl
        self.shape = torch.Size(sl.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._slice[:] if len(self.shape) else self._slice[()]  # 0-dim: a per-tensor scale


def iterate_weights(model_dir: str) -> Iterator[tuple[str, SliceSource]]:
    for path in checkpoint_files(model_dir):
        try:  # safetensors checks the header and the file's length against it here
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"cannot read the weights file {path} (corrupt or truncated?): {e}") from None
        with handle as f:
            for name in f.keys():
                yield name, SliceSource(f.get_slice(name))


def checkpoint_target(name: str, mapping: dict, name_target=None) -> tuple[str, object]:
    """A checkpoint tensor's name -> (our parameter's name, shard id or None): the family's own
    ``remap_checkpoint_name`` first, else the fused ``packed_modules_mapping``."""
    mapped = name_target(name) if name_target is not None else None
    if mapped is not None:
        return mapped
    for frag, (fused, sid) in mapping.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), sid
    return name, None


def load_weights(model: nn.Module, model_dir: str, weights: Optional[Iterator] = None) -> None:
    """Every checkpoint tensor into the parameter that owns it: the safetensors of ``model_dir``,
    or ``weights`` ((name, source) pairs: a GGUF file's tensors) when given."""
    params = dict(model.named_parameters())
    mapping: dict = getattr(model, "packed_modules_mapping", {})
    # A family's own names (e.g. per-expert tensors into stacked expert weights): name ->
    # (parameter, shard id or None), or None for the generic mapping below.
    name_target = getattr(model, "remap_checkpoint_name", None)
    from pagedllm.models.pipeline import missing_prefixes

    elsewhere = missing_prefixes(model)  # pipeline parallel: modules other stages own (their tensors are skipped)
    tie = bool(getattr(model, "tie_word_embeddings", False))
    loaded: set[str] = set()
    saw_lm_head = False
    weights = iterate_weights(model_dir) if weights is None else weights
    rewrite = getattr(model, "checkpoint_tensors", None)  # families whose tensors are renamed/split first
    for name, tensor in rewrite(weights) if rewrite is not None else weights:
        if "rotary_emb.inv_freq" in name:
            continue
        target, shard_id = checkpoint_target(name, mapping, name_target)
        if target.startswith("lm_head."):
            saw_lm_head = True
        param = params.get(target)
        if param is None and elsewhere and target.startswith(elsewhere):
            if target == "model.embed_tokens.weight" and "lm_head.weight" in params and (tie or not saw_lm_head):
                target, param = "lm_head.weight", params["lm_head.weight"]  # a last stage's tied head
            else:
                continue
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
        loaded.add(target)
    if (tie or not saw_lm_head) and "lm_head." not in elsewhere and "model.embed_tokens." not in elsewhere:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = [n for n in params if n not in loaded and not n.startswith("lm_head.")]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
