"""StreamSet: the engine streams of one API request (one per prompt), merged, with its deadline.

Every prompt of a request is one engine request; a request's streams are merged and closed
together, so a client that goes away aborts all of its engine requests. Admission errors (bad
input, full queue, dead engine) surface from ``start()``, before any byte is sent. A request past
its deadline, or still running when a shutdown's drain time ends (``fail``), raises while
iterating; the caller's ``close()`` aborts what still runs.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from pagedllm.engine.async_llm import sequences_of
from pagedllm.entrypoints.openai.serving_errors import RequestTimeout
from pagedllm.sampling_params import SamplingParams


class StreamSet:
    """One AsyncLLM stream per prompt, merged: iterating yields (prompt index, RequestOutput).
    Past ``timeout`` seconds, or after ``fail(error)``, iterating raises (and the caller's
    ``close()`` aborts the engine requests)."""

    def __init__(self, engine, items: list[tuple[Any, SamplingParams, str]], timeout: Optional[float] = None,
                 live: Optional[set] = None, lora_request=None) -> None:
        self._engine, self._items = engine, items
        self._lora = {"lora_request": lora_request} if lora_request is not None else {}  # the request's adapter
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._errors: list[BaseException] = []
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._core_kw = dict(self._lora, **({"deadline": self._deadline} if self._deadline is not None else {}))
        self._live = live if live is not None else set()  # every open set, so a shutdown can end them
        self._live.add(self)

    def fail(self, error: BaseException) -> None:
        """End the iteration with ``error`` (from the event loop's thread)."""
        self._queue.put_nowait((-1, error))

    async def start(self) -> "StreamSet":
        """Admit every prompt; on any failure (a refusal, the caller cancelled) the set is closed
        before the error leaves: nothing stays in the live set or keeps generating."""
        try:
            self._engine.check_can_fit(sum(sequences_of(p) for _, p, _ in self._items))  # all prompts together
            for i, (prompt, params, rid) in enumerate(self._items):
                self._tasks.append(asyncio.create_task(self._pump(i, self._engine.generate(prompt, params, rid,
                                                                                          **self._core_kw))))
            # One loop turn runs each generate() up to its first wait: admission errors show up now.
            await asyncio.sleep(0)
            if self._errors:
                raise self._errors[0]
        except BaseException:
            self.close()
            raise
        return self

    async def _pump(self, i: int, gen) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((i, out))
            self._queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._errors.append(e)
            self._queue.put_nowait((i, e))

    async def __aiter__(self):
        remaining = len(self._tasks)
        while remaining:
            if self._deadline is None:
                i, item = await self._queue.get()
            else:
                try:
                    i, item = await asyncio.wait_for(self._queue.get(), max(0.0, self._deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise RequestTimeout(self._timeout) from None
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            elif self._expired(item):  # the core ended it at the deadline it carries (core/deadlines.py)
                raise RequestTimeout(self._timeout)
            else:
                yield i, item

    def _expired(self, item) -> bool:
        return (self._deadline is not None and item.finished and time.monotonic() >= self._deadline
                and any(o.finish_reason == "abort" for o in item.outputs))

    def close(self) -> None:
        """Cancel every pump: each engine stream is closed, which aborts its request. Synchronous,
        so it is safe inside a cancelled scope."""
        self._live.discard(self)
        for t in self._tasks:
            if not t.done():
                t.cancel()
