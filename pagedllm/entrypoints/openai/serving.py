"""Completions and chat completions over AsyncLLM: request -> SamplingParams -> engine streams ->
OpenAI responses (whole, or server-sent-event chunks).

OpenAIServing is the API server's one object for the generating routes. The work is in thin
layers, each written once:

- serving_base: the shared steps from a validated request to admitted engine streams (model,
  tokenising, SamplingParams, constraint compile, logprob bounds) and ServingOptions;
- stream_set: a request's engine streams merged, with its deadline and shutdown;
- stream_consumer: the engine outputs consumed (usage, errors, disconnects, the reasoning split,
  tool-call extraction), whole or streamed;
- serving_completions, serving_chat (and responses): one adapter per API, mapping its request
  and response shapes;
- serving_errors: APIError and how any failure becomes one; chat_prompt: chat template rendering.

Every prompt of a request is one engine request; a request's streams are merged (StreamSet) and
closed together, so a client that goes away aborts all of its engine requests. Admission errors
(bad input, full queue, dead engine) surface before any byte is sent, as HTTP errors. A request
past its deadline, or still running when a shutdown's drain time ends, is aborted and ends with
an error (an error event and ``[DONE]`` when streaming).

Tokenising and chat-template rendering run on worker threads (the light tokenizer releases the
GIL for long texts), bounded: a text that could never fit max_model_len is refused before it is
tokenised, and a chat template sent with a request is refused unless the server trusts them
(``--trust-request-chat-template``), then rendered in a TemplateSandbox (another process,
bounded in time, memory and output).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.chat_prompt import render_chat
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_completions import CompletionRequest
from pagedllm.entrypoints.openai.serving_base import ServingBase, ServingOptions
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_completions import ServingCompletions
from pagedllm.entrypoints.openai.serving_errors import (  # noqa: F401  (re-exported)
    APIError, RequestTimeout, ShuttingDown, bad_request, internal_error, sse, to_api_error,
)
from pagedllm.entrypoints.openai.stream_set import StreamSet  # noqa: F401  (re-exported)

__all__ = ["APIError", "OpenAIServing", "RequestTimeout", "ServingOptions", "ShuttingDown", "StreamSet",
           "bad_request", "internal_error", "sse", "to_api_error"]


class OpenAIServing(ServingBase):
    """The generating APIs over one engine: ``completions`` and ``chat`` (and ServingResponses
    over this), /tokenize and /detokenize."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], model_path: str,
                 options: Optional[ServingOptions] = None) -> None:
        super().__init__(engine, served_model_names, model_path, options)
        self.completions = ServingCompletions(self)
        self.chat = ServingChat(self)

    async def create_completion(self, req: CompletionRequest, timeout: Optional[float] = None):
        return await self.completions.create(req, timeout)

    async def create_chat_completion(self, req: ChatCompletionRequest, timeout: Optional[float] = None):
        return await self.chat.create(req, timeout)

    async def start_chat(self, req: ChatCompletionRequest, timeout: Optional[float] = None,
                         request_id: Optional[str] = None):
        """Validate, render and admit a chat request: (streams, id, model name, prompt length, tool
        plan). /v1/chat/completions and /v1/responses both start their generations here."""
        return await self.chat.start(req, timeout, request_id)

    # ---- /tokenize, /detokenize -------------------------------------------------------------
    async def tokenize(self, req) -> list[int]:
        self.check_model(req.model)
        self.require_tokenizer("this server has no tokenizer", "prompt")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            self.check_text_length(req.prompt, "prompt")
            return list(await asyncio.to_thread(self.tokenizer.encode, req.prompt,
                                                add_special_tokens=req.add_special_tokens))
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=req.chat_template_kwargs)
        return await render_chat(self, chat)

    def detokenize(self, req) -> str:
        self.check_model(req.model)
        self.require_tokenizer("this server has no tokenizer", "tokens")
        if any(not 0 <= t < self.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {self.vocab_size})", "tokens")
        return self.tokenizer.decode(req.tokens)
