"""The scheduler's grammar source (core/grammar_wait.py's GrammarSource) over a StructuredOutputManager.

The scheduler holds a constrained request as WAITING_FOR_GRAMMAR and asks this object: ``submit``
starts its compile on the manager's pool; ``ready`` (when the request reaches the head of the
queue) says whether the compile is done -- then it starts the request's matcher over the tokens
it already has -- and raises when it failed or took longer than ``structured_compile_timeout``;
``bitmask`` fills the masks of the step's sampling constrained requests (for SchedulerOutput);
``accept`` advances a matcher over the tokens the scheduler appended; ``remove`` forgets a request
(withdrawing its compile).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Iterable, Optional

from pagedllm.core.contracts import GrammarBitmask
from pagedllm.core.grammar_wait import Advance
from pagedllm.core.request import Request

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager


def grammar_source(tokenizer, vocab_size: int, eos_token_ids, config) -> Optional["StructuredOutputs"]:
    """The engine's grammar source over a new StructuredOutputManager, or None without a
    tokenizer (constrained requests are then refused). xgrammar is imported on first use."""
    if tokenizer is None:
        return None
    from pagedllm.structured_output.backend import CompileIsolation
    from pagedllm.structured_output.limits import CompileLimits
    from pagedllm.structured_output.manager import StructuredOutputManager

    return StructuredOutputs(StructuredOutputManager(tokenizer, vocab_size, list(eos_token_ids),
                                                     CompileLimits.from_config(config),
                                                     CompileIsolation.from_config(config)))


def close_grammar_source(source: Optional["StructuredOutputs"]) -> None:
    """Shut its manager's compile pool down (nothing without one)."""
    if source is not None:
        source.manager.shutdown()


class StructuredOutputs:
    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self.compiling: dict[str, tuple[Future, float]] = {}  # request id -> its compile, since

    @property
    def num_compiling(self) -> int:
        return len(self.compiling)

    @property
    def num_matching(self) -> int:
        """Constrained requests running (their matchers started)."""
        return len(self.manager.matchers)

    def submit(self, request: Request) -> None:
        fut = self.manager.submit(request.sampling_params.structured_outputs)
        self.compiling[request.request_id] = (fut, time.monotonic())

    def ready(self, request: Request) -> bool:
        rid = request.request_id
        fut, since = self.compiling[rid]
        if not fut.done():
            if time.monotonic() - since <= self.manager.limits.timeout:
                return False
            del self.compiling[rid]
            fut.cancel()
            raise self.manager.timeout_error(request.sampling_params.structured_outputs)
        del self.compiling[rid]
        try:
            self.manager.start(rid, fut.result(), request.output_token_ids, request.prompt_token_ids,
                               request.sampling_params.structured_outputs.reasoning_tags)
        except BaseException:
            self.manager.remove(rid)
            raise
        return True

    def wait(self, timeout: float) -> None:
        if self.compiling:
            wait([f for f, _ in self.compiling.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def bitmask(self, req_ids: list[str]) -> Optional[GrammarBitmask]:
        return self.manager.step_grammar(req_ids)

    def accept(self, req_id: str, tokens: list[int], stop_token_ids: Iterable[int]) -> Optional[Advance]:
        return self.manager.advance(req_id, tokens, stop_token_ids)

    def remove(self, req_id: str) -> None:
        entry = self.compiling.pop(req_id, None)
        if entry is not None:
            entry[0].cancel()
        self.manager.remove(req_id)
