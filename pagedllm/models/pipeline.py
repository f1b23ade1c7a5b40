"""Pipeline parallelism in the models: a stage builds only its own decoder layers.

The layers of other stages are ``PPMissingLayer`` placeholders (no parameters, so the loader
skips their checkpoint tensors); the first stage holds the embedding, the last the final norm
and the LM head. A family opts in with ``supports_pp = True`` and a forward that takes
``intermediate`` (the tensors the previous stage sent) and returns them for the next stage.
"""
from __future__ import annotations

from torch import nn


class PPMissingLayer(nn.Module):
    """A module another pipeline stage owns: no weights, never run here."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


def stage_module(owned: bool, build) -> nn.Module:
    """``build()`` on the stage that owns the module, a placeholder elsewhere."""
    return build() if owned else PPMissingLayer()


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter name prefixes ("model.layers.7.") of the modules other stages own."""
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


def check_pipeline_support(model_cls) -> None:
    from pagedllm.distributed.parallel_state import get_pp_group

    if get_pp_group().world_size > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(f"{model_cls.__name__} does not support pipeline_parallel_size > 1 yet (supported: the "
                         "Llama family -- Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen2/3-MoE); use "
                         "tensor_parallel_size instead")
