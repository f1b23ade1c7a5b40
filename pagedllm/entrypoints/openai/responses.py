"""The Responses API (``/v1/responses``) over the chat pipeline.

A request's ``input`` (text, or message / function_call / function_call_output items) after the
conversation of its ``previous_response_id`` becomes chat messages (``instructions`` as the
system message, never carried over to the next response, as OpenAI); ``text.format`` becomes
response_format, ``tools`` / ``tool_choice`` the chat tools (function tools only), and
OpenAIServing.start_chat admits it. The output comes back as Responses output items (an
assistant message with output_text, function_call items), whole or as the Responses stream
events (response.created ... response.completed, each with its sequence_number). With
``--reasoning-parser`` the reasoning comes first as a reasoning item (streamed as
response.reasoning_text.delta events) and counts as ``output_tokens_details.reasoning_tokens``;
``include: ["message.output_text.logprobs"]`` fills output_text.logprobs (each with
``top_logprobs`` alternatives), whole and per streamed delta.

``ResponseStore`` keeps stored responses (``store`` true, the default) in memory, bounded in
count and in characters of conversation, oldest evicted first; ``store: false`` keeps nothing,
so such a response cannot be retrieved or continued. ``background: true`` answers at once with
status ``in_progress``, generates in a task, and may be cancelled. Stored responses are keyed by
ids the server makes (``resp_<uuid>``); a request's ``request_id`` names only its engine request,
so no client can replace or continue as its own another client's stored response by naming it.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream
from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
    ReasoningItem, ReasoningText, ResponseErrorInfo, ResponseObject, ResponsesRequest, ResponseUsage,
)
from pagedllm.entrypoints.openai.serving_errors import APIError, to_api_error
from pagedllm.entrypoints.openai.stream_consumer import Choice as _Choice

# Chat fields an error may name -> the Responses field the client sent.
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
_THINK_END = "</think>"


def _rename(e: APIError) -> APIError:
    if e.param in _FIELD_NAMES:
        e.message = e.message.replace(e.param, _FIELD_NAMES[e.param])
        e.param = _FIELD_NAMES[e.param]
    return e


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---- input items -> chat messages -----------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                       f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn go in one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning item handed back: the chat template does not see earlier reasoning
        else:
            raise _bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                       f"{where}.type")
    return messages


def output_logprobs(req: ResponsesRequest) -> Optional[int]:
    """The top_logprobs alternatives per output token when ``include`` asks for output_text
    logprobs (0 without top_logprobs), else None; another ``include`` entry is a 400."""
    for i, name in enumerate(req.include or []):
        if name != _INCLUDE_LOGPROBS:
            raise _bad(f"include[{i}] {name!r} is not supported here (only {_INCLUDE_LOGPROBS!r})", f"include[{i}]")
    return (req.top_logprobs or 0) if _INCLUDE_LOGPROBS in (req.include or []) else None


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"messages": messages, "model": req.model, "max_completion_tokens": req.max_output_tokens}
    top = output_logprobs(req)
    if top is not None:
        body["logprobs"], body["top_logprobs"] = True, top
    if req.reasoning is not None:
        if req.reasoning.summary is not None or req.reasoning.generate_summary is not None:
            field = "reasoning.summary" if req.reasoning.summary is not None else "reasoning.generate_summary"
            raise _bad(f"{field} is not supported: this server writes no reasoning summaries (the reasoning itself "
                       "comes as a reasoning item with --reasoning-parser)", field)
        if req.reasoning.effort is not None:  # vLLM's rule: a chat template variable
            body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise _bad("text.format of type json_schema needs a schema", "text.format.schema")
            spec = {"name": fmt.name or "response", "schema": fmt.json_schema}
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            body["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise _bad(f"input: {e}", "input") from None


# ---- the store ------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # the messages a follow-up continues (without instructions)
    input_items: list[dict[str, Any]]
    size: int = 0
    task: Optional[asyncio.Task] = None  # a background response's generation
    streams: Any = None
    top_logprobs: Optional[int] = None  # include output_text logprobs with this many alternatives (None: none)


class ResponseStore:
    """Stored responses by id, bounded: at most ``max_entries`` and about ``max_chars``
    characters of conversation; the least recently stored or read go first."""

    def __init__(self, max_entries: int = 1024, max_chars: int = 64 << 20) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, rid: str) -> Optional[StoredResponse]:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self.pop(entry.response.id)
        entry.size = len(json.dumps(entry.conversation, ensure_ascii=False)) + len(json.dumps(entry.input_items))
        self._entries[entry.response.id] = entry
        self._chars += entry.size
        while len(self._entries) > self.max_entries or (self._chars > self.max_chars and len(self._entries) > 1):
            self.pop(next(iter(self._entries)))

    def pop(self, rid: str) -> Optional[StoredResponse]:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._chars -= entry.size
        return entry


# ---- serving --------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(prompt_len: int, output: int, cached: int, reasoning: int = 0) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_len, output_tokens=output, total_tokens=prompt_len + output,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning))


def reasoning_token_count(tokenizer, token_ids: list[int], reasoning: Optional[str], content: Optional[str]) -> int:
    """How many of the output's tokens are reasoning: none without reasoning, all when no content
    follows it, else the shortest prefix whose text holds the closing ``</think>`` (found by
    bisection: O(log n) decodes)."""
    if not reasoning or tokenizer is None:
        return 0
    if content is None:
        return len(token_ids)
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if _THINK_END in tokenizer.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


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


class ServingResponses:
    def __init__(self, serving, store: Optional[ResponseStore] = None) -> None:
        self.serving = serving
        self.store = store if store is not None else ResponseStore()

    async def create(self, req: ResponsesRequest, timeout: Optional[float] = None):
        if req.background and not req.store:
            raise _bad("background needs store (a background response is read back by its id)", "background")
        if req.background and req.stream:
            raise _bad("background with stream is not supported: stream, or poll a background response", "stream")
        conversation: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found (it was not "
                                    "stored, was deleted, or was evicted from this server's store)",
                               param="previous_response_id", code="previous_response_not_found")
            if prev.response.status not in ("completed", "incomplete"):
                raise _bad(f"previous response {prev.response.id} is {prev.response.status}: only a finished "
                           "response can be continued", "previous_response_id")
            conversation = list(prev.conversation)
        new_items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
            else list(req.input)
        conversation += input_messages(req.input)
        chat = chat_request(req, conversation)
        # the stored response's id is always the server's: a client-chosen request_id names the engine
        # request (logs, aborts) but never a store entry, so it cannot replace another client's response
        rid = _new_id("resp")
        try:
            streams, _, model, prompt_len, plan = await self.serving.start_chat(chat, timeout, req.request_id or rid)
        except APIError as e:
            raise _rename(e) from None
        response = ResponseObject(
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
        entry = StoredResponse(response, conversation, new_items, top_logprobs=output_logprobs(req))
        if req.background:
            response.status = "queued"
            entry.streams = streams
            self.store.put(entry)
            entry.task = asyncio.create_task(self._background(entry, streams, plan, prompt_len))
            return response.model_copy(deep=True)
        if req.stream:
            return streams, self._stream(entry, streams, plan, prompt_len)
        await self._collect(entry, streams, plan, prompt_len)
        return response

    def _keep(self, entry: StoredResponse) -> None:
        if entry.response.store:
            entry.conversation = entry.conversation + [_conversation_turn(entry.response.output)]
            self.store.put(entry)

    async def _collect(self, entry: StoredResponse, streams, plan, prompt_len: int) -> None:
        choice, cached = _Choice(), 0
        try:
            async for _, out in streams:
                cached = out.num_cached_tokens
                for o in out.outputs:
                    choice.add(o)
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            streams.close()
        response = entry.response
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        text, thought = "".join(choice.text), None
        thinking = self.serving.reasoning_parser
        if thinking is not None:  # --reasoning-parser: a reasoning item first, the rest is the reply
            thought, rest = thinking.extract(text)
            text = rest or ""
            if thought:
                response.output.append(ReasoningItem(id=_new_id("rs"), status="completed" if rest is not None
                                                     else status, content=[ReasoningText(text=thought)]))
        n_reasoning = reasoning_token_count(self.serving.tokenizer, choice.token_ids, thought,
                                            text if thinking is None or text else None)
        content, calls = tc.parse_output(plan, text)
        if content:
            lps = self._logprobs(entry, choice.token_ids[n_reasoning:], choice.logprobs[n_reasoning:])
            response.output.append(OutputMessage(id=_new_id("msg"), status=status,
                                                 content=[OutputText(text=content, logprobs=lps)]))
        for call in tc.tool_calls(calls):
            response.output.append(FunctionCallItem(id=_new_id("fc"), call_id=call.id, name=call.function.name,
                                                    arguments=call.function.arguments))
        response.usage = _usage(prompt_len, len(choice.token_ids), cached, n_reasoning)
        _finish(response, choice.finish_reason)
        self._keep(entry)

    def _logprobs(self, entry: StoredResponse, token_ids: list[int], logprobs: list) -> list[dict[str, Any]]:
        """output_text.logprobs (token, logprob, bytes, top_logprobs) of these tokens, or [] when
        the request did not include them."""
        if entry.top_logprobs is None or not token_ids:
            return []
        table = lp_format.chat_logprobs(token_ids, logprobs, entry.top_logprobs, self.serving.tokenizer)
        return [t.model_dump() for t in table.content]

    async def _background(self, entry: StoredResponse, streams, plan, prompt_len: int) -> None:
        entry.response.status = "in_progress"
        try:
            await self._collect(entry, streams, plan, prompt_len)
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
            streams.close()
        except Exception as e:
            err = to_api_error(e)
            entry.response.status, entry.response.error = "failed", ResponseErrorInfo(code=err.code, message=err.message)
        finally:
            entry.task = entry.streams = None

    # ---- streaming ----------------------------------------------------------------------------
    async def _stream(self, entry: StoredResponse, streams, plan, prompt_len: int) -> AsyncIterator[str]:
        events = _EventWriter(entry.response)
        tools = tc.ToolStream(plan) if plan is not None and plan.active else None
        thinking = self.serving.reasoning_parser
        split = ReasoningStream(thinking) if thinking is not None else None  # --reasoning-parser
        token_ids: list[int] = []
        pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not been sent yet
        cached, reason = 0, None
        try:
            yield events.emit("response.created", response=entry.response.model_dump())
            yield events.emit("response.in_progress", response=entry.response.model_dump())
            async for _, out in streams:
                cached = out.num_cached_tokens
                for o in out.outputs:
                    token_ids.extend(o.token_ids)
                    pending += self._logprobs(entry, list(o.token_ids), o.logprobs or [])
                    finished = o.finish_reason is not None
                    if finished:
                        reason = o.finish_reason
                    text = o.text
                    if split is not None:
                        thought, text = split.feed(o.text, finished)
                        if thought:
                            for ev in events.reasoning(thought):
                                yield ev
                            if not text:
                                pending = []  # reasoning tokens: no output_text logprobs
                    if tools is None:
                        deltas = [(text, None)] if text else []
                    else:
                        deltas = [(d.content, d.tool_calls) for d in tools.feed(text, finished)]
                    for text, calls in deltas:
                        for ev in (events.text(text, pending) if text else events.calls(calls or [])):
                            yield ev
                        pending = []
            for ev in events.close_all("incomplete" if reason == "length" else "completed"):
                yield ev
            thought, rest = thinking.extract(split.text) if split is not None else (None, None)
            entry.response.usage = _usage(prompt_len, len(token_ids), cached,
                                          reasoning_token_count(self.serving.tokenizer, token_ids, thought, rest))
            _finish(entry.response, reason)
            self._keep(entry)
            kind = "response.incomplete" if entry.response.status == "incomplete" else "response.completed"
            yield events.emit(kind, response=entry.response.model_dump())
        except Exception as e:
            err = to_api_error(e)
            entry.response.status = "failed"
            entry.response.error = ResponseErrorInfo(code=err.code, message=err.message)
            yield events.emit("error", code=err.code, message=err.message, param=err.param)
            yield events.emit("response.failed", response=entry.response.model_dump())
        finally:
            streams.close()

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
            raise _bad("Only responses created with background=true can be cancelled", "response_id")
        task = entry.task
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        return entry.response


class _EventWriter:
    """The Responses stream events of one response: output items opened and closed in order."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.seq = 0
        self.message: Optional[OutputMessage] = None
        self.thought: Optional[ReasoningItem] = None  # the open reasoning item
        self.open_calls: dict[int, FunctionCallItem] = {}  # ToolStream call index -> its open item

    def emit(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _index(self, item) -> int:
        return next(i for i, x in enumerate(self.response.output) if x is item)

    def reasoning(self, delta: str) -> list[str]:
        out = []
        if self.thought is None:
            self.thought = ReasoningItem(id=_new_id("rs"), status="in_progress", content=[])
            self.response.output.append(self.thought)
            idx = self._index(self.thought)
            out.append(self.emit("response.output_item.added", output_index=idx, item=self.thought.model_dump()))
            self.thought.content.append(ReasoningText(text=""))
            out.append(self.emit("response.content_part.added", item_id=self.thought.id, output_index=idx,
                                 content_index=0, part=self.thought.content[0].model_dump()))
        self.thought.content[0].text += delta
        out.append(self.emit("response.reasoning_text.delta", item_id=self.thought.id,
                             output_index=self._index(self.thought), content_index=0, delta=delta))
        return out

    def _close_reasoning(self, status: str) -> list[str]:
        r, self.thought = self.thought, None
        return self._close_part(r, status, "response.reasoning_text.done") if r is not None else []

    def _close_part(self, item, status: str, done: str, **extra) -> list[str]:
        """The events that close an item of one text part: ``done`` (with the part's text),
        content_part.done and output_item.done."""
        idx, part = self._index(item), item.content[0]
        item.status = status
        return [self.emit(done, item_id=item.id, output_index=idx, content_index=0, text=part.text, **extra),
                self.emit("response.content_part.done", item_id=item.id, output_index=idx, content_index=0,
                          part=part.model_dump()),
                self.emit("response.output_item.done", output_index=idx, item=item.model_dump())]

    def text(self, delta: str, logprobs: list = ()) -> list[str]:
        out = self._close_reasoning("completed") + self._close_calls("completed")
        if self.message is None:
            self.message = OutputMessage(id=_new_id("msg"), status="in_progress", content=[])
            self.response.output.append(self.message)
            idx = self._index(self.message)
            out.append(self.emit("response.output_item.added", output_index=idx, item=self.message.model_dump()))
            self.message.content.append(OutputText(text=""))
            out.append(self.emit("response.content_part.added", item_id=self.message.id, output_index=idx,
                                 content_index=0, part=self.message.content[0].model_dump()))
        self.message.content[0].text += delta
        self.message.content[0].logprobs.extend(logprobs)
        out.append(self.emit("response.output_text.delta", item_id=self.message.id,
                             output_index=self._index(self.message), content_index=0, delta=delta,
                             logprobs=list(logprobs)))
        return out

    def calls(self, deltas) -> list[str]:
        out = []
        for d in deltas:
            item = self.open_calls.get(d.index)
            if item is None:
                out += self._close_reasoning("completed") + self._close_message("completed") + \
                    self._close_calls("completed")
                item = FunctionCallItem(id=_new_id("fc"), call_id=d.id or tc.new_call_id(), status="in_progress",
                                        name=(d.function.name if d.function else None) or "", arguments="")
                self.open_calls[d.index] = item
                self.response.output.append(item)
                out.append(self.emit("response.output_item.added", output_index=self._index(item),
                                     item=item.model_dump()))
            args = d.function.arguments if d.function is not None else None
            if args:
                item.arguments += args
                out.append(self.emit("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self._index(item), delta=args))
        return out

    def _close_message(self, status: str) -> list[str]:
        m, self.message = self.message, None
        if m is None:
            return []
        return self._close_part(m, status, "response.output_text.done", logprobs=m.content[0].logprobs)

    def _close_calls(self, status: str) -> list[str]:
        out = []
        for item in self.open_calls.values():
            if item.status != "in_progress":
                continue
            item.status = status
            idx = self._index(item)
            out.append(self.emit("response.function_call_arguments.done", item_id=item.id, output_index=idx,
                                 name=item.name, arguments=item.arguments))
            out.append(self.emit("response.output_item.done", output_index=idx, item=item.model_dump()))
        return out

    def close_all(self, status: str) -> list[str]:
        return self._close_reasoning(status) + self._close_message(status) + self._close_calls(status)
