"""LoRA adapters in the server: ``--lora-modules`` (``name=path`` or vLLM's JSON
``{"name": ..., "path": ..., "base_model_name": ...}``), their ``/v1/models`` cards (``parent`` =
the base), and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` at run time (only with
``--allow-runtime-lora-updating``; behind the API key like every route). A bad adapter is refused
with the reason (400) and the server goes on; a request's ``model`` naming no adapter gets 404."""
from __future__ import annotations

import asyncio
import itertools
import json
from typing import Optional, Sequence

from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.openai.serving import APIError
from pagedllm.lora.request import LoRARequest

_ids = itertools.count(1)


def parse_lora_modules(values: Sequence[str]) -> list[LoRARequest]:
    """``name=path`` or a JSON object with name and path (and base_model_name) per value."""
    out: list[LoRARequest] = []
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {value!r} is not valid JSON: {e}") from None
            unknown = sorted(set(spec) - {"name", "path", "base_model_name"})
            if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(f"lora_modules: {value!r} needs string 'name' and 'path' (and optionally "
                                 f"'base_model_name'){'; unknown ' + str(unknown) if unknown else ''}")
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        else:
            name, sep, path = text.partition("=")
            base = None
            if not sep:
                raise ValueError(f"lora_modules: {value!r} is not name=path or a JSON object")
        if not name or not path:
            raise ValueError(f"lora_modules: {value!r} needs a non-empty name and path")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out.append(LoRARequest(name, next(_ids), path, base))
    return out


def register_lora_modules(engine, modules: Sequence[str], base_names: Sequence[str]) -> None:
    """Check and register the startup adapters (ValueError names the first bad one)."""
    if not modules:
        return
    registry = engine.lora_registry
    if registry is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for request in parse_lora_modules(modules):
        if request.lora_name in base_names:
            raise ValueError(f"lora_modules: the adapter name {request.lora_name!r} is the base model's name")
        registry.add(request)


def lora_model_cards(serving, max_model_len: Optional[int]) -> list[ModelCard]:
    registry = serving.loras if serving is not None else None
    if registry is None:
        return []
    base = serving.served_model_names[0]
    return [ModelCard(id=r.lora_name, root=r.lora_path, parent=r.base_model_name or base, max_model_len=max_model_len)
            for r in registry.requests()]


def _registry(serving, allowed: bool):
    if not allowed:
        raise APIError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--allow-runtime-lora-updating", code="not_found")
    if serving.loras is None:
        raise APIError(400, "this server was started without --enable-lora", code="lora_disabled")
    return serving.loras


async def load_lora_adapter(serving, req: LoadLoRAAdapterRequest, allowed: bool) -> str:
    registry = _registry(serving, allowed)
    if req.lora_name in serving.served_model_names or registry.get(req.lora_name) is not None:
        raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded (or names the base model)",
                       param="lora_name", code="invalid_value")
    try:
        await asyncio.to_thread(registry.add, LoRARequest(req.lora_name, next(_ids), req.lora_path))
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


async def unload_lora_adapter(serving, req: UnloadLoRAAdapterRequest, allowed: bool) -> str:
    registry = _registry(serving, allowed)
    if not registry.remove(req.lora_name):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                       code="not_found")
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
