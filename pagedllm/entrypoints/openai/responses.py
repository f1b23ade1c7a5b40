"""The Responses API (``/v1/responses``) over the chat pipeline.

A request becomes a chat request (responses_input: ``input`` after the conversation of its
``previous_response_id``, ``instructions``, ``text.format``, function ``tools``), which
OpenAIServing.start_chat admits. The output (stream_consumer: reasoning split, tool calls read
out) comes back as Responses output items (an assistant message with output_text, function_call
items), whole or as the Responses stream events (responses_events: response.created ...
response.completed, each with its sequence_number). With ``--reasoning-parser`` the reasoning
comes first as a reasoning item (streamed as response.reasoning_text.delta events) and counts as
``output_tokens_details.reasoning_tokens``; ``include: ["message.output_text.logprobs"]`` fills
output_text.logprobs (each with ``top_logprobs`` alternatives), whole and per streamed delta.

Responses are kept in a ResponseStore (responses_store; ``store: false`` keeps nothing).
``background: true`` answers at once with status ``in_progress``, generates in a task, and may be
cancelled. Stored responses are keyed by ids the server makes (``resp_<uuid>``); a request's
``request_id`` names only its engine request, so no client can replace or continue as its own
another client's stored response by naming it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterable, Optional

from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.responses_events import EventWriter, new_id
from pagedllm.entrypoints.openai.responses_input import (  # noqa: F401  (input_messages re-exported)
    chat_request, input_messages, output_logprobs, rename_error,
)
from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
    ReasoningItem, ReasoningText, ResponseErrorInfo, ResponseObject, ResponsesRequest, ResponseUsage,
)
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request, to_api_error
from pagedllm.entrypoints.openai.stream_consumer import (  # noqa: F401  (reasoning_token_count re-exported)
    Delta, StreamConsumer, StreamWriter, reasoning_token_count,
)

__all__ = ["ResponseStore", "ServingResponses", "StoredResponse", "chat_request", "input_messages",
           "output_logprobs", "reasoning_token_count"]


def _usage(prompt_len: int, output: int, cached: int, reasoning: int = 0) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_len, output_tokens=output, total_tokens=prompt_len + output,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))


def _finish(response: ResponseObject, reason: Optional[str]) -> None:
    response.completed_at = int(time.time())
    if reason == "length":
        response.status, response.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
    elif reason == "abort":
        response.status = "cancelled"
    elif reason == "error":
        response.status = "failed"
        response.error = ResponseErrorInfo(code="request_failed", message="the engine failed this request")
    else:
        response.status = "completed"


def _conversation_turn(output: list) -> dict[str, Any]:
    """The assistant message the output items make, for the next response's conversation."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in output if isinstance(c, FunctionCallItem)]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _response_object(req: ResponsesRequest, rid: str, model: str) -> ResponseObject:
    """The response as created: the request's settings echoed, no output yet."""
    return ResponseObject(
        id=rid, model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id, temperature=req.temperature, top_p=req.top_p,
        tool_choice=(req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                     else req.tool_choice.model_dump()) or ("auto" if req.tools else "none"),
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        parallel_tool_calls=req.parallel_tool_calls is not False, store=req.store, background=req.background,
        text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
        metadata=req.metadata or {}, user=req.user, top_logprobs=req.top_logprobs,
        reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None)


class ServingResponses:
    def __init__(self, serving, store: Optional[ResponseStore] = None) -> None:
        self.serving = serving  # the OpenAIServing (start_chat, tokenizer, reasoning_parser)
        self.store = store if store is not None else ResponseStore()

    async def create(self, req: ResponsesRequest, timeout: Optional[float] = None):
        """The response, or (streams, its events) when streaming."""
        if req.background and not req.store:
            raise bad_request("background needs store (a background response is read back by its id)", "background")
        if req.background and req.stream:
            raise bad_request("background with stream is not supported: stream, or poll a background response",
                              "stream")
        conversation = self._continued(req.previous_response_id)
        new_items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
            else list(req.input)
        conversation += input_messages(req.input)
        chat = chat_request(req, conversation)
        # the stored response's id is always the server's: a client-chosen request_id names the engine
        # request (logs, aborts) but never a store entry, so it cannot replace another client's response
        rid = new_id("resp")
        try:
            streams, _, model, prompt_len, plan = await self.serving.start_chat(chat, timeout, req.request_id or rid)
        except APIError as e:
            raise rename_error(e) from None
        response = _response_object(req, rid, model)
        entry = StoredResponse(response, conversation, new_items, top_logprobs=output_logprobs(req))
        if req.background:
            response.status = "queued"
            entry.streams = streams
            self.store.put(entry)
            entry.task = asyncio.create_task(self._background(entry, streams, plan, prompt_len))
            return response.model_copy(deep=True)
        if req.stream:
            return streams, self.stream(entry, streams, plan, prompt_len)
        await self.collect(entry, streams, plan, prompt_len)
        return response

    def _continued(self, previous_id: Optional[str]) -> list[dict[str, Any]]:
        """The conversation a request continues (none without previous_response_id)."""
        if previous_id is None:
            return []
        prev = self.store.get(previous_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{previous_id}' not found (it was not "
                                "stored, was deleted, or was evicted from this server's store)",
                           param="previous_response_id", code="previous_response_not_found")
        if prev.response.status not in ("completed", "incomplete"):
            raise bad_request(f"previous response {prev.response.id} is {prev.response.status}: only a finished "
                              "response can be continued", "previous_response_id")
        return list(prev.conversation)

    def keep(self, entry: StoredResponse) -> None:
        """Store a finished response (with its reply as the conversation's next turn), if it is stored."""
        if entry.response.store:
            entry.conversation = entry.conversation + [_conversation_turn(entry.response.output)]
            self.store.put(entry)

    def logprobs(self, entry: StoredResponse, token_ids: list[int], logprobs: list) -> list[dict[str, Any]]:
        """output_text.logprobs (token, logprob, bytes, top_logprobs) of these tokens, or [] when
        the request did not include them."""
        if entry.top_logprobs is None or not token_ids:
            return []
        table = lp_format.chat_logprobs(token_ids, logprobs, entry.top_logprobs, self.serving.tokenizer)
        return [t.model_dump() for t in table.content]

    async def collect(self, entry: StoredResponse, streams, plan, prompt_len: int) -> None:
        """Generate the whole response: its output items, usage and status."""
        consumer = StreamConsumer(streams, prompt_len, self.serving.reasoning_parser, plan)
        reply = (await consumer.collect()).first()
        response, choice = entry.response, reply.choice
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        if reply.thought:  # --reasoning-parser: a reasoning item first, the rest is the reply
            response.output.append(ReasoningItem(id=new_id("rs"), status="completed" if reply.rest is not None
                                                 else status, content=[ReasoningText(text=reply.thought)]))
        n_reasoning = reasoning_token_count(self.serving.tokenizer, choice.token_ids, reply.thought, reply.rest)
        if reply.content:
            lps = self.logprobs(entry, choice.token_ids[n_reasoning:], choice.logprobs[n_reasoning:])
            response.output.append(OutputMessage(id=new_id("msg"), status=status,
                                                 content=[OutputText(text=reply.content, logprobs=lps)]))
        for call in tc.tool_calls(reply.calls):
            response.output.append(FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.function.name,
                                                    arguments=call.function.arguments))
        response.usage = _usage(prompt_len, len(choice.token_ids), consumer.cached_tokens, n_reasoning)
        _finish(response, choice.finish_reason)
        self.keep(entry)

    async def _background(self, entry: StoredResponse, streams, plan, prompt_len: int) -> None:
        entry.response.status = "in_progress"
        try:
            await self.collect(entry, streams, plan, prompt_len)
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
            streams.close()
        except Exception as e:
            err = to_api_error(e)
            entry.response.status, entry.response.error = "failed", ResponseErrorInfo(code=err.code, message=err.message)
        finally:
            entry.task = entry.streams = None

    def stream(self, entry: StoredResponse, streams, plan, prompt_len: int) -> AsyncIterator[str]:
        """The response's stream events, from response.created to response.completed (or failed)."""
        consumer = StreamConsumer(streams, prompt_len, self.serving.reasoning_parser, plan)
        return consumer.stream(_ResponseWriter(self, entry, consumer))

    # ---- stored responses ---------------------------------------------------------------------
    def _stored(self, rid: str) -> StoredResponse:
        entry = self.store.get(rid)
        if entry is None:
            raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
        return entry

    def retrieve(self, rid: str) -> ResponseObject:
        return self._stored(rid).response

    def input_items(self, rid: str) -> list[dict[str, Any]]:
        return self._stored(rid).input_items

    def delete(self, rid: str) -> None:
        entry = self._stored(rid)
        if entry.task is not None:
            entry.task.cancel()
        self.store.pop(rid)

    async def cancel(self, rid: str) -> ResponseObject:
        entry = self._stored(rid)
        if not entry.response.background:
            raise bad_request("Only responses created with background=true can be cancelled", "response_id")
        task = entry.task
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        return entry.response


class _ResponseWriter(StreamWriter):
    """A streamed response's events: each delta's reasoning, text (with its logprobs) and tool
    calls as output item events; at the end the items closed, usage, status and the store."""

    def __init__(self, adapter: ServingResponses, entry: StoredResponse, consumer: StreamConsumer) -> None:
        self.adapter, self.entry, self.consumer = adapter, entry, consumer
        self.events = EventWriter(entry.response)
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not been sent yet
        self.reason: Optional[str] = None

    def start(self) -> Iterable[str]:
        yield self.events.emit("response.created", response=self.entry.response.model_dump())
        yield self.events.emit("response.in_progress", response=self.entry.response.model_dump())

    def delta(self, d: Delta) -> Iterable[str]:
        o = d.raw
        self.pending += self.adapter.logprobs(self.entry, list(o.token_ids), o.logprobs or [])
        if o.finish_reason is not None:
            self.reason = o.finish_reason
        if d.thought:
            yield from self.events.reasoning(d.thought)
            if not d.content:
                self.pending = []  # reasoning tokens: no output_text logprobs
        if d.tool_deltas is None:
            deltas = [(d.content, None)] if d.content else []
        else:
            deltas = [(m.content, m.tool_calls) for m in d.tool_deltas]
        for text, calls in deltas:
            yield from (self.events.text(text, self.pending) if text else self.events.calls(calls or []))
            self.pending = []

    def end(self) -> Iterable[str]:
        yield from self.events.close_all("incomplete" if self.reason == "length" else "completed")
        response, consumer = self.entry.response, self.consumer
        response.usage = _usage(consumer.prompt_tokens, consumer.completion_tokens, consumer.cached_tokens,
                                consumer.reasoning_tokens(self.adapter.serving.tokenizer))
        _finish(response, self.reason)
        self.adapter.keep(self.entry)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield self.events.emit(kind, response=response.model_dump())

    def error(self, err: APIError) -> Iterable[str]:
        response = self.entry.response
        response.status = "failed"
        response.error = ResponseErrorInfo(code=err.code, message=err.message)
        yield self.events.emit("error", code=err.code, message=err.message, param=err.param)
        yield self.events.emit("response.failed", response=response.model_dump())
