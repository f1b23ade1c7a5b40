"""StructuredOutputManager: the engine's side of constrained decoding.

Lifecycle of a constrained request (driven by the scheduler through engine/structured_outputs.py):
 1. ``submit``: its constraint is checked against the limits (structured_output/limits.py) and
    compiled on the manager's own bounded pool (cached by the constraint's text, in bytes); the
    request waits in the scheduler's queue (WAITING_FOR_GRAMMAR) while others run on. ``validate`` waits for it (at most
    ``structured_compile_timeout``), for callers that want the error at once (LLM.generate); the
    server awaits ``submit``'s future itself, so a client that goes away withdraws its compile.
 2. ``start``: once compiled, a GrammarMatcher is made for it (one per sequence: n > 1 fans out
    into separate requests, each with its own); with ``reasoning_tags``, behind a ReasoningGate
    (structured_output/reasoning_gate.py): no mask until the output's reasoning has ended.
 3. each step, ``step_grammar``: the allowed-token bitmask of every constrained request that
    samples this step, filled in one batched call, carried to the runner in SchedulerOutput.grammar
    (the sampling rank applies it to the logits before sampling).
 4. ``advance``: the matcher accepts the tokens the scheduler appended. Preemption recomputes
    the KV cache but keeps the accepted tokens, so the matcher stays where it is; a step that
    fails is rewound before any token is appended, so the matcher never saw it either.
 5. ``remove`` when the request finishes or is aborted.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Iterable, Optional, Sequence

from pagedllm.core.contracts import GrammarBitmask
from pagedllm.core.grammar_wait import Advance
from pagedllm.heap import trim_freed_memory
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import CompileIsolation, GrammarBackend, import_xgrammar, spec_key
from pagedllm.structured_output.compile_process import CompileDeadlineError
from pagedllm.structured_output.limits import CompileLimits, CompilePoolFullError, CompileTimeoutError, compile_timeout
from pagedllm.structured_output.reasoning_gate import ReasoningGate, prompt_closes_reasoning

logger = logging.getLogger(__name__)


def _relay(shared: Future, mine: Future) -> None:
    """A caller's future takes the shared compile's outcome (unless the caller withdrew)."""
    if shared.cancelled():
        mine.cancel()
        return
    try:
        if shared.exception() is not None:
            mine.set_exception(shared.exception())
        else:
            mine.set_result(shared.result())
    except InvalidStateError:  # the caller withdrew meanwhile
        pass


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 limits: Optional[CompileLimits] = None, isolation: Optional[CompileIsolation] = None) -> None:
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self.limits = limits or CompileLimits()
        self.isolation = isolation  # compiles in worker processes (None: on the pool's threads)
        self._abandoned: set[tuple[str, str]] = set()  # compiles running that nobody waits for any more
        self._backend: Optional[GrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], Future] = {}  # compiles queued or running, by constraint
        self._waiters: dict[tuple[str, str], int] = {}  # callers still waiting on each
        self.matchers: dict[str, Any] = {}
        self.gates: dict[str, ReasoningGate] = {}  # requests whose grammar waits for their reasoning to end
        self._tag_cache: dict[str, tuple[int, ...]] = {}  # a reasoning tag's token ids

    @property
    def backend(self) -> GrammarBackend:
        """Built on first use (importing xgrammar and reading the vocabulary take a second or two)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = GrammarBackend(*self._args, cache_bytes=self.limits.cache_bytes,
                                               isolation=self.isolation)
            return self._backend

    # ---- compile ----------------------------------------------------------------------------
    def validate(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec`` now (cached): ValueError naming the field if it does not compile or is
        over a limit; CompileTimeoutError if it takes longer than the limit (the compile goes on
        in the pool and is cached when it ends)."""
        fut = self.submit(spec)
        try:
            fut.result(timeout=self.limits.timeout)
        except FutureTimeout:
            fut.cancel()
            raise self.timeout_error(spec) from None

    def timeout_error(self, spec: StructuredOutputsParams) -> CompileTimeoutError:
        return compile_timeout(spec, self.limits.timeout)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The caller's own future of ``spec``'s CompiledGrammar, compiled on the manager's pool
        (``limits.workers`` threads of its own, never the tokenizer's). Limits are checked here
        (ValueError at once); the same constraint in flight is compiled once for all its callers;
        cancelling the future withdraws the caller, and a compile nobody waits for any more is
        dropped if it has not started. CompilePoolFullError when workers + queue are all taken
        (compiles abandoned while running still count until they end)."""
        import_xgrammar()  # a missing extra is the caller's error, at once
        key = spec_key(spec)
        self.limits.check(spec, key)
        mine: Future = Future()
        hit = self._backend.cached(key) if self._backend is not None else None
        if hit is not None:
            mine.set_result(hit)
            return mine
        started = None
        with self._lock:
            shared = self._inflight.get(key)
            if shared is None:
                busy = len(self._inflight)
                if busy >= self.limits.workers + self.limits.max_queued:
                    raise CompilePoolFullError(
                        f"{busy} grammar compiles are queued or running, the limit is structured_compile_workers + "
                        f"structured_max_queued_compiles = {self.limits.workers + self.limits.max_queued}; retry later")
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="pagedllm-grammar")
                shared = started = self._pool.submit(self._compile, key)
                self._inflight[key] = shared
            self._waiters[key] = self._waiters.get(key, 0) + 1
            self._abandoned.discard(key)
        if started is not None:  # outside the lock: a compile that already ended runs _done (which locks) right here
            started.add_done_callback(lambda f, k=key: self._done(k, f))
        shared.add_done_callback(lambda f: _relay(f, mine))
        mine.add_done_callback(lambda f, k=key: self._withdraw(k, f))
        return mine

    def _compile(self, key: tuple[str, str]):
        hit = self.backend.cached(key)
        if hit is not None:
            return hit
        try:  # in a worker process, stopped once nobody waits or past the timeout
            return self.backend.compile_key(key, self.limits.timeout, lambda: key in self._abandoned)
        except CompileDeadlineError:
            raise CompileTimeoutError(f"structured_outputs.{key[0]} did not compile within the limit of "
                                      f"{self.limits.timeout:g} s (structured_compile_timeout); it was stopped") from None

    def _done(self, key, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
                self._waiters.pop(key, None)
                self._abandoned.discard(key)
        trim_freed_memory()

    def _withdraw(self, key, mine: Future) -> None:
        if not mine.cancelled():
            return
        with self._lock:
            left = self._waiters.get(key, 0) - 1
            shared = self._inflight.get(key)
            if left > 0:
                self._waiters[key] = left
                return
            self._waiters.pop(key, None)
            if shared is not None:
                self._abandoned.add(key)
        if shared is not None:
            # dropped if still queued; a running one is stopped in its worker process (on a
            # thread it cannot be: it ends and is cached)
            shared.cancel()

    @property
    def num_inflight_compiles(self) -> int:
        return len(self._inflight)

    def stats(self) -> dict:
        """Compiles run, grammars cached and their bytes, compiles in flight (plain ints)."""
        b = self._backend
        return {"compiles": b.num_compiles if b else 0, "cached": len(b._cache) if b else 0,
                "cache_bytes": b.cache_size_bytes if b else 0, "inflight": self.num_inflight_compiles}

    # ---- per request ------------------------------------------------------------------------
    def start(self, req_id: str, compiled, replay: Iterable[int] = (), prompt_ids: Sequence[int] = (),
              reasoning_tags: Optional[tuple[str, str]] = None) -> None:
        """A matcher for ``req_id``, advanced over tokens it already produced (``replay``); with
        ``reasoning_tags``, behind a ReasoningGate unless ``prompt_ids`` already closed the reasoning."""
        m = self.backend.matcher(compiled)
        replay = list(replay)
        gate = None
        if reasoning_tags is not None:
            start_ids, end_ids = (self._tag_ids(t) for t in reasoning_tags)
            if not prompt_closes_reasoning(prompt_ids, start_ids, end_ids):
                gate = ReasoningGate(end_ids)
                after = gate.feed(replay)
                if after is None:  # still reasoning: the matcher starts later
                    replay = []
                else:  # the replayed output already closed it: no gate
                    replay, gate = after, None
        for tok in replay:
            if not m.accept_token(tok):
                raise ValueError(f"request {req_id}: its output so far does not match its grammar")
        self.matchers[req_id] = m
        if gate is not None:
            self.gates[req_id] = gate

    def _tag_ids(self, tag: str) -> tuple[int, ...]:
        ids = self._tag_cache.get(tag)
        if ids is None:
            ids = self._tag_cache[tag] = tuple(self._args[0].encode(tag, add_special_tokens=False))
        if not ids:
            raise ValueError(f"structured_outputs.reasoning_tags: {tag!r} has no tokens")
        return ids

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.gates.pop(req_id, None)

    def step_grammar(self, sampling_req_ids: list[str]) -> Optional[GrammarBitmask]:
        """The bitmask rows of the constrained requests among ``sampling_req_ids`` (the requests
        that produce a token this step), or None when none is constrained. A new array each
        step: with steps in flight (pipeline stages, an asynchronous executor) an earlier step's
        masks must not change under it."""
        ids = [r for r in sampling_req_ids if r in self.matchers and r not in self.gates]
        if not ids:
            return None
        backend = self.backend
        bitmask = backend.allocate_bitmask(len(ids))
        backend.batch_fill([self.matchers[r] for r in ids], bitmask)
        return GrammarBitmask({r: i for i, r in enumerate(ids)}, bitmask)

    def advance(self, req_id: str, tokens: list[int], stop_token_ids: Iterable[int]) -> Optional[Advance]:
        """Accept ``tokens`` (the request's new output tokens); None if it is unconstrained."""
        m = self.matchers.get(req_id)
        if m is None:
            return None
        gate = self.gates.get(req_id)
        if gate is not None:  # still reasoning: the grammar starts after the end tag
            tokens = gate.feed(tokens)
            if tokens is None:
                return Advance(False, False)
            del self.gates[req_id]
        stops = set(stop_token_ids)
        for tok in tokens:
            if m.is_terminated():
                break
            if not m.accept_token(tok):
                if tok in stops:  # a stop token of the request's own (stop_token_ids): the scheduler stops it
                    return Advance(False, False)
                logger.error("request %s: token %d is not allowed by its grammar", req_id, tok)
                return Advance(True, False)
        return Advance(False, m.is_terminated())

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.shutdown()
