"""Pipeline parallelism in the models: a stage builds only its own decoder layers.

The layers of other stages are ``PPMissingLayer`` placeholders (no parameters, so the loader
skips their checkpoint tensors); the first stage holds the embedding, the last the final norm
and the LM head. A family opts in with ``supports_pp = True`` and a forward that takes
``intermediate`` (the tensors the previous stage sent) and returns them for the next stage.
"""
from __future__ import annotations

from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group


class PPMissingLayer(nn.Module):
    """A module another pipeline stage owns: no weights, never run here."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


def stage_module(owned: bool, build) -> nn.Module:
    """``build()`` on the stage that owns the module, a placeholder elsewhere."""
    return build() if owned else PPMissingLayer()


def stage_layers(num_layers: int, build) -> tuple[nn.ModuleList, int, int, bool, bool]:
    """(layers, start, end, is_first, is_last): ``build(i)`` for this stage's layers [start, end),
    placeholders for the others (the indices stay the checkpoint's)."""
    pp = get_pp_group()
    start, end = pp.layer_range(num_layers)
    layers = nn.ModuleList([build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)])
    return layers, start, end, pp.is_first, pp.is_last


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter name prefixes ("model.layers.7.") of the modules other stages own, and any other
    names a family leaves to them (``pp_missing_names``)."""
    prefixes = tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
    return prefixes + tuple(getattr(model, "pp_missing_names", ()))


def check_pipeline_support(model_cls) -> None:
    if get_pp_group().world_size > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(f"{model_cls.__name__} does not support pipeline_parallel_size > 1 yet; use "
                         "tensor_parallel_size instead")
