"""/v1/chat/completions: its request mapped onto the shared serving steps (the tool plan, the
rendered prompt, SamplingParams, admission), its outputs (stream_consumer: reasoning split and
tool calls applied) mapped to chat messages, whole or as ``chat.completion.chunk`` deltas.

``start`` admits a chat request; /v1/responses starts its generations there too. The stream's
role chunk comes with the first output (after prefill, as vLLM's), so a client timing its first
token from the first chunk measures it right.
"""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Iterable, Optional

from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.chat_prompt import render_chat
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, ChatStreamChoice, DeltaMessage,
)
from pagedllm.entrypoints.openai.protocol_chunks import ChatChunks
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request
from pagedllm.entrypoints.openai.stream_consumer import Delta, SSEWriter, StreamConsumer
from pagedllm.entrypoints.openai.structured import request_constraint
from pagedllm.outputs import RequestOutput


def chat_echo(req) -> str:
    """vLLM's chat echo: the reply starts with the final message's content when that message is
    the assistant's (the one continue_final_message continues)."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        content = "\n".join(p.text or "" for p in content)
    return content or ""


class ServingChat:
    def __init__(self, serving) -> None:
        self.serving = serving  # the ServingBase

    async def create(self, req: ChatCompletionRequest, timeout: Optional[float] = None):
        """The response, or (streams, its chunks) when streaming."""
        streams, rid, model, prompt_len, plan = await self.start(req, timeout)
        if req.stream:
            return streams, self.stream(req, streams, rid, model, prompt_len, plan)
        return await self.full(req, streams, rid, model, prompt_len, plan)

    async def start(self, req: ChatCompletionRequest, timeout: Optional[float] = None,
                    request_id: Optional[str] = None):
        """Validate, render and admit a chat request: (streams, id, model name, prompt length, tool plan)."""
        serving = self.serving
        model = serving.check_model(req.model)
        plan = self._tool_plan(req)
        images: list = []
        prompt: dict[str, Any] = {"prompt_token_ids": await render_chat(serving, req, plan.tools, images)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        processed = await serving.process(prompt, "messages", req.truncate_prompt_tokens)
        ids = processed.token_ids
        params = self._params(req, len(ids), plan)
        await serving.check_constraint(req, params, "tools" if plan.constraint is not None else None)
        rid = request_id or f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        streams = await serving.start([(serving.engine_prompt(req, ids, mm_features=processed.mm_features), params,
                                        rid)], serving.timeout(req, timeout), model)
        return streams, rid, model, len(ids), plan

    def _tool_plan(self, req: ChatCompletionRequest) -> tc.ToolPlan:
        options, max_tools = self.serving.options, self.serving.engine.config.max_tools
        if req.tools and len(req.tools) > max_tools:  # each is rendered into the prompt and may become a grammar
            raise bad_request(f"tools has {len(req.tools)} entries, over the limit of {max_tools} (max_tools)", "tools")
        plan = tc.plan_tools(req, options.enable_auto_tool_choice, options.tool_call_parser, bad_request)
        if req.mm_processor_kwargs and self.serving.input_processor.images is not None:
            raise APIError(400, f"mm_processor_kwargs ({', '.join(sorted(map(str, req.mm_processor_kwargs)))}): this "
                                "server's image preprocessing takes no per-request options (it resizes and crops as "
                                "the checkpoint's preprocessor config says)", param="mm_processor_kwargs",
                           code="unsupported_field")
        return plan

    def _params(self, req: ChatCompletionRequest, prompt_len: int, plan: tc.ToolPlan):
        serving = self.serving
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        serving.check_prompt_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        aliases = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        params = serving.sampling_params(req, prompt_len, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                         req.prompt_logprobs, aliases=aliases, tool_choice=req.tool_choice)
        serving.check_logprob_volume([(prompt_len, params)], None, req.prompt_logprobs)
        if plan.parser is not None and plan.parser.KEEPS_SPECIAL_TOKENS:  # its markers are special tokens
            params.skip_special_tokens = False  # (vLLM's parsers turn skip_special_tokens off for them too)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise bad_request(f"tool_choice {plan.mode!r} constrains the output, and so does "
                                  f"{request_constraint(req, bad_request)[1]}: pass one", "tool_choice")
            params.structured_outputs = plan.constraint
        thinking = serving.reasoning_parser
        if thinking is not None and params.structured_outputs is not None:  # the answer is constrained, not the reasoning
            params.structured_outputs.reasoning_tags = thinking.tags
        return params

    def logprobs(self, req, token_ids, logprobs):
        if not req.logprobs:
            return None
        return lp_format.chat_logprobs(token_ids, logprobs or [], req.top_logprobs or 0, self.serving.tokenizer)

    async def full(self, req, streams, rid: str, model: str, prompt_len: int,
                   plan: Optional[tc.ToolPlan] = None) -> ChatCompletionResponse:
        consumer = StreamConsumer(streams, prompt_len, self.serving.reasoning_parser, plan)
        whole = await consumer.collect()
        result, echo = [], chat_echo(req)
        for (_, k), r in whole.replies.items():
            content = r.content
            if echo and (content is not None or not r.calls):
                content = echo + (content or "")
            message = ChatMessage(role=self.serving.options.response_role, content=content,
                                  tool_calls=tc.tool_calls(r.calls), reasoning_content=r.thought)
            result.append(ChatChoice(index=k, message=message, logprobs=self.logprobs(req, r.choice.token_ids,
                                                                                      r.choice.logprobs),
                                     finish_reason=r.finish_reason, stop_reason=r.choice.stop_reason,
                                     token_ids=r.choice.token_ids if req.return_token_ids else None))
        last: Optional[RequestOutput] = whole.last.get(0)
        return ChatCompletionResponse(id=rid, model=model, choices=result, usage=consumer.usage(),
                                      prompt_logprobs=self.serving.prompt_logprobs(req, last),
                                      prompt_token_ids=(last.prompt_token_ids if req.return_token_ids and last else None))

    def stream(self, req, streams, rid: str, model: str, prompt_len: int,
               plan: Optional[tc.ToolPlan] = None) -> AsyncIterator[str]:
        consumer = StreamConsumer(streams, prompt_len, self.serving.reasoning_parser, plan)
        return consumer.stream(_ChatWriter(self, req, consumer, rid, model))


class _ChatWriter(SSEWriter):
    def __init__(self, adapter: ServingChat, req, consumer: StreamConsumer, rid: str, model: str) -> None:
        super().__init__(req, consumer, lambda: ChatChunks(rid, model))
        self.adapter, self.req = adapter, req
        self.role, self.echo = adapter.serving.options.response_role, chat_echo(req)
        self.plain = not req.logprobs and not req.return_token_ids and not self.usage_each  # the usual chunk

    def _chunk(self, index: int, delta: DeltaMessage, **kw) -> str:
        return self.chunks.model_chunk([ChatStreamChoice(index=index, delta=delta, **kw)], self.usage_now())

    def first(self, out: RequestOutput) -> Iterable[str]:
        for k in range(self.req.n):
            choice = ChatStreamChoice(index=k, delta=DeltaMessage(role=self.role, content=""))
            yield self.chunks.model_chunk(
                [choice], self.usage_now(),
                prompt_token_ids=out.prompt_token_ids if self.req.return_token_ids and k == 0 else None)
            if self.echo:
                yield self._chunk(k, DeltaMessage(content=self.echo))

    def delta(self, d: Delta) -> Iterable[str]:
        o = d.raw
        if self.plain and not d.thought and d.tool_deltas is None and not d.held:  # the usual chunk, quickly
            return (self.chunks.content(o.index, d.content, o.finish_reason, o.stop_reason),)
        return self._deltas(d)

    def _deltas(self, d: Delta) -> Iterable[str]:
        o = d.raw
        if d.thought:  # --reasoning-parser: reasoning_content deltas first
            yield self._chunk(o.index, DeltaMessage(reasoning_content=d.thought))
        if d.held:
            return
        if d.tool_deltas is not None:  # tool calls: content and tool_calls deltas, then the finish
            for delta in d.tool_deltas:
                yield self._chunk(o.index, delta)
            if o.finish_reason is not None:
                yield self._chunk(o.index, DeltaMessage(), finish_reason=d.finish_reason, stop_reason=o.stop_reason)
            return
        if self.plain:
            yield self.chunks.content(o.index, d.content, o.finish_reason, o.stop_reason)
            return
        yield self._chunk(o.index, DeltaMessage(content=d.content),
                          logprobs=self.adapter.logprobs(self.req, o.token_ids, o.logprobs),
                          finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                          token_ids=list(o.token_ids) if self.req.return_token_ids else None)
