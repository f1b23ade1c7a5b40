"""/tokenize and /detokenize: a generative server's tokenizer, or a pooling server's (as vLLM's)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedllm.entrypoints.openai.body_parsing import OffLoopBodyRoute
from pagedllm.entrypoints.openai.middleware import json_response
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
)
from pagedllm.entrypoints.openai.server_state import ServerState, current_server

router = APIRouter(route_class=OffLoopBodyRoute)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: ServerState = Depends(current_server)):
    if state.pooling is not None and not state.draining:  # a pooling server tokenizes too (as vLLM's)
        return await state.pooling.tokenize(req)
    serving = state.require()
    tokens = await serving.tokenize(req)
    return json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len))


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: ServerState = Depends(current_server)):
    if state.pooling is not None and not state.draining:
        return await state.pooling.detokenize(req)
    return json_response(DetokenizeResponse(prompt=state.require().detokenize(req)))
