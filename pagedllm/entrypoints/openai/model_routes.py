"""The model routes: /v1/models and /v1/models/{id} (the served names and the LoRA adapters), and
the runtime LoRA ones, /v1/load_lora_adapter and /v1/unload_lora_adapter (with
``--allow-runtime-lora-updating``)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from pagedllm.entrypoints.openai import lora_modules
from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.middleware import json_response
from pagedllm.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest, ModelCard, ModelList, UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.server_state import ServerState, current_server
from pagedllm.entrypoints.openai.serving import APIError

router = APIRouter(route_class=OffLoopBodyRoute)


async def _max_model_len(state: ServerState):
    """The served model's max_model_len: the generating engine's, or the pooling engine's on a
    pooling server; while loading, the one it is configured for."""
    if state.serving is not None:
        return state.engine.max_model_len
    if state.pooling is not None:
        return state.pooling.max_model_len
    return await asyncio.to_thread(state.planned_max_model_len)


@router.get("/v1/models/{model_id:path}")
async def model_card(model_id: str, state: ServerState = Depends(current_server)):
    max_len = await _max_model_len(state)
    cards = [ModelCard(id=n, root=state.model_path, max_model_len=max_len) for n in state.served_model_names]
    for card in cards + lora_modules.lora_model_cards(state.serving, max_len):
        if card.id == model_id:
            return json_response(card)
    raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")


@router.get("/v1/models")
async def models(state: ServerState = Depends(current_server)):
    max_len = await _max_model_len(state)
    return json_response(ModelList(data=[ModelCard(id=n, root=state.model_path, max_model_len=max_len)
                                         for n in state.served_model_names]
                                   + lora_modules.lora_model_cards(state.serving, max_len)))


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, state: ServerState = Depends(current_server)):
    text = await lora_modules.load_lora_adapter(state.require(), req, state.args.allow_runtime_lora_updating)
    return Response(content=text, media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, state: ServerState = Depends(current_server)):
    text = await lora_modules.unload_lora_adapter(state.require(), req, state.args.allow_runtime_lora_updating)
    return Response(content=text, media_type="text/plain")
