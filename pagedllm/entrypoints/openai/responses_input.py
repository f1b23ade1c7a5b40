"""A Responses request as a chat request: ``input`` (text, or message / function_call /
function_call_output items) after the conversation of its ``previous_response_id`` becomes chat
messages (``instructions`` as the system message, never carried over to the next response, as
OpenAI); ``text.format`` becomes response_format, ``tools`` / ``tool_choice`` the chat tools
(function tools only). An error the chat pipeline raises names the Responses field the client
sent (``rename_error``)."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request

# Chat fields an error may name -> the Responses field the client sent.
_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "parallel_tool_calls")


def rename_error(e: APIError) -> APIError:
    """``e`` naming the Responses field where it names a chat field."""
    if e.param in _FIELD_NAMES:
        e.message = e.message.replace(e.param, _FIELD_NAMES[e.param])
        e.param = _FIELD_NAMES[e.param]
    return e


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got {kind!r}",
                              f"{where}[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
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
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                  f"{where}.role")
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
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                              f"{where}.type")
    return messages


def output_logprobs(req: ResponsesRequest) -> Optional[int]:
    """The top_logprobs alternatives per output token when ``include`` asks for output_text
    logprobs (0 without top_logprobs), else None; another ``include`` entry is a 400."""
    for i, name in enumerate(req.include or []):
        if name != _INCLUDE_LOGPROBS:
            raise bad_request(f"include[{i}] {name!r} is not supported here (only {_INCLUDE_LOGPROBS!r})",
                              f"include[{i}]")
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
            raise bad_request(f"{field} is not supported: this server writes no reasoning summaries (the reasoning "
                              "itself comes as a reasoning item with --reasoning-parser)", field)
        if req.reasoning.effort is not None:  # vLLM's rule: a chat template variable
            body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    body.update(req.model_dump(include=set(_SAMPLING), exclude_none=True))
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    response_format = _response_format(req)
    if response_format is not None:
        body["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:
        raise bad_request(f"input: {e}", "input") from None


def _response_format(req: ResponsesRequest) -> Optional[dict[str, Any]]:
    """``text.format`` as chat's response_format (None: free text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type != "json_schema":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
    spec = {"name": fmt.name or "response", "schema": fmt.json_schema}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}
