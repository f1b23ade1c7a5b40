"""The Responses stream events of one response (``event: <type>`` / ``data: {...}``, each with its
sequence_number): output items (reasoning, message, function calls) opened, filled and closed
in order, the response's output kept in step with what was sent."""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem, OutputMessage, OutputText, ReasoningItem, ReasoningText, ResponseObject,
)


def new_id(prefix: str) -> str:
    """A server-made id: ``resp_``, ``msg_``, ``rs_``, ``fc_`` and a uuid."""
    return f"{prefix}_{uuid.uuid4().hex}"


class EventWriter:
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

    def _open(self, item, part) -> list[str]:
        """Add an item of one text part to the output: output_item.added, content_part.added."""
        self.response.output.append(item)
        idx = self._index(item)
        out = [self.emit("response.output_item.added", output_index=idx, item=item.model_dump())]
        item.content.append(part)
        out.append(self.emit("response.content_part.added", item_id=item.id, output_index=idx, content_index=0,
                             part=part.model_dump()))
        return out

    def reasoning(self, delta: str) -> list[str]:
        out = []
        if self.thought is None:
            self.thought = ReasoningItem(id=new_id("rs"), status="in_progress", content=[])
            out += self._open(self.thought, ReasoningText(text=""))
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
            self.message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
            out += self._open(self.message, OutputText(text=""))
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
                item = FunctionCallItem(id=new_id("fc"), call_id=d.id or tc.new_call_id(), status="in_progress",
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
