"""The Responses API's store: stored responses (``store`` true, the default) in memory, bounded in
count and in characters of conversation, the least recently stored or read evicted first.
``store: false`` keeps nothing, so such a response cannot be retrieved or continued."""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.entrypoints.openai.responses_protocol import ResponseObject


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
