"""One consumer of a request's engine outputs, for every API (completions, chat, responses).

The engine's outputs come in from a StreamSet; what goes out is the same for every API, written
once here: the token counts and cached tokens (usage), the ``--reasoning-parser`` split of each
choice (reasoning apart from the reply), the tool calls read out of the reply under the
request's tool plan, the engine's and the deadline's errors as APIErrors, and the closing of the
engine streams on every way out (finished, failed, or the client gone). An adapter only maps the
result to its API's shapes:

- ``collect()`` reads the stream to the end: each choice whole, as a Reply.
- ``stream(writer)`` hands the writer each choice's delta (a Delta, reasoning split and tool
  deltas applied) as it comes and writes out what the writer makes of it, its error form on a
  failure, and its trailer (``[DONE]``) after either.
"""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Callable, Iterable, Optional, Union

from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.protocol_base import PromptTokensDetails, UsageInfo
from pagedllm.entrypoints.openai.protocol_chunks import StreamChunks
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from pagedllm.entrypoints.openai.serving_errors import APIError, sse, to_api_error
from pagedllm.outputs import CompletionOutput, RequestOutput

_THINK_END = "</think>"


@dataclasses.dataclass
class Choice:
    """One choice's output, accumulated from its streamed deltas."""

    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def add(self, delta) -> None:
        """Fold one streamed CompletionOutput delta into the accumulated choice."""
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclasses.dataclass
class Reply:
    """A finished choice: the reasoning split off and the tool calls read out of the rest."""

    choice: Choice
    thought: Optional[str]  # the reasoning (None: none, or no reasoning parser)
    rest: Optional[str]  # the text after the reasoning (None: it was all reasoning); all of it without a parser
    content: Optional[str]  # ``rest`` less its tool calls (None: nothing but reasoning, or only calls)
    calls: list  # ParsedToolCall
    finish_reason: Optional[str]  # "tool_calls" where the tool plan says so


@dataclasses.dataclass
class Whole:
    replies: dict[tuple[int, int], Reply]  # by (prompt index, choice index), in order
    last: dict[int, RequestOutput]  # each prompt's last engine output (prompt ids and logprobs)

    def first(self) -> Reply:
        """The one reply of a one-choice request (an empty one if the engine sent nothing)."""
        return next(iter(self.replies.values()), None) or _reply(Choice(), None, tc.ToolPlan())


@dataclasses.dataclass(slots=True)
class Delta:
    """One choice's new output, as the writers see it."""

    prompt: int  # the prompt's index
    output: RequestOutput  # the engine output it came in (prompt ids, prompt logprobs)
    raw: CompletionOutput  # the engine's delta: index, text, token ids, logprobs, finish and stop reason
    first: bool  # the choice's first delta
    thought: str  # its reasoning ("" without a reasoning parser)
    content: str  # the text after the reasoning split (all of ``raw.text`` without a parser)
    held: bool  # nothing but reasoning so far, and not finished: no content to write yet
    tool_deltas: Optional[list]  # DeltaMessages under an active tool plan (None: no plan, or held)
    finish_reason: Optional[str]  # the tool plan's finish reason ("tool_calls"), else the engine's


class StreamWriter:
    """What an API writes of a stream; each method returns the strings to send."""

    def start(self) -> Iterable[str]:
        return ()

    def first(self, out: RequestOutput) -> Iterable[str]:
        """With the request's first engine output (after prefill)."""
        return ()

    def delta(self, d: Delta) -> Iterable[str]:
        return ()

    def end(self) -> Iterable[str]:
        return ()

    def error(self, err: APIError) -> Iterable[str]:
        return ()

    def done(self) -> Iterable[str]:
        """After the end or the error."""
        return ()


class SSEWriter(StreamWriter):
    """A completions or chat stream: ``data:`` chunks with usage (so far, on every chunk with
    stream_options.continuous_usage_stats; a usage chunk at the end with include_usage), an
    error chunk, then ``[DONE]``. ``make_chunks()`` makes the stream's StreamChunks when it
    starts (its ``created`` is the stream's)."""

    def __init__(self, req, consumer: "StreamConsumer", make_chunks: Callable[[], StreamChunks]) -> None:
        options = req.stream_options
        self.consumer, self.make_chunks = consumer, make_chunks
        self.chunks: Optional[StreamChunks] = None
        self.usage_each = bool(options and options.continuous_usage_stats)
        self.include_usage = bool(options and options.include_usage)

    def start(self) -> Iterable[str]:
        self.chunks = self.make_chunks()
        return ()

    def usage_now(self) -> Optional[UsageInfo]:
        return self.consumer.usage() if self.usage_each else None

    def end(self) -> Iterable[str]:
        return (self.chunks.model_chunk([], self.consumer.usage()),) if self.include_usage else ()

    def error(self, err: APIError) -> Iterable[str]:
        return (sse(err.body()),)

    def done(self) -> Iterable[str]:
        return ("data: [DONE]\n\n",)


@dataclasses.dataclass(slots=True)
class _Track:
    """One choice's state while streaming."""

    split: Optional[ReasoningStream]
    tools: Optional[tc.ToolStream]
    token_ids: list[int] = dataclasses.field(default_factory=list)  # with a reasoning split (reasoning_tokens)
    done: bool = False  # its last delta came


def usage_info(prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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


def _reply(choice: Choice, parser: Optional[ReasoningParser], plan: tc.ToolPlan) -> Reply:
    thought, rest = None, "".join(choice.text)
    if parser is not None:  # the reasoning apart, the rest is the reply
        thought, rest = parser.extract(rest)
    content, calls = tc.parse_output(plan, rest or "")
    if parser is not None and not rest:
        content = None
    return Reply(choice, thought, rest, content, calls, tc.finish_reason(plan, calls, choice.finish_reason))


class StreamConsumer:
    """A request's engine outputs (a StreamSet, or anything iterating (prompt index, output) with
    ``close()``), read once, whole or streamed; ``prompt_tokens`` counts every prompt's tokens."""

    def __init__(self, streams, prompt_tokens: int, reasoning: Optional[ReasoningParser] = None,
                 plan: Optional[tc.ToolPlan] = None) -> None:
        self.streams, self.prompt_tokens = streams, prompt_tokens
        self.reasoning, self.plan = reasoning, plan or tc.ToolPlan()
        self.completion_tokens = 0
        self.cached: dict[int, int] = {}  # per prompt: its latest output's cached prompt tokens
        self._tracks: dict[tuple[int, int], _Track] = {}

    def usage(self, completion_tokens: Optional[int] = None) -> UsageInfo:
        tokens = self.completion_tokens if completion_tokens is None else completion_tokens
        return usage_info(self.prompt_tokens, tokens, self.cached_tokens)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    async def collect(self) -> Whole:
        """Every choice, whole; any failure raises as an APIError. The streams are closed."""
        choices: dict[tuple[int, int], Choice] = {}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in self.streams:
                last[i], self.cached[i] = out, out.num_cached_tokens
                for o in out.outputs:
                    choices.setdefault((i, o.index), Choice()).add(o)
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            self.streams.close()
        self.completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return Whole({k: _reply(c, self.reasoning, self.plan) for k, c in sorted(choices.items())}, last)

    async def stream(self, writer: StreamWriter) -> AsyncIterator[str]:
        """What ``writer`` makes of the stream; a failure (the engine's, the deadline's, or the
        writer's own) is written as ``writer.error``. The streams are closed on every way out."""
        started = False
        try:
            for s in writer.start():
                yield s
            delta_of, write = self._delta, writer.delta
            async for i, out in self.streams:
                self.cached[i] = out.num_cached_tokens
                if not started:
                    started = True
                    for s in writer.first(out):
                        yield s
                for o in out.outputs:
                    d = delta_of(i, out, o)
                    if d is not None:
                        for s in write(d):
                            yield s
            for s in writer.end():
                yield s
        except Exception as e:
            for s in writer.error(to_api_error(e)):
                yield s
        finally:
            self.streams.close()
        for s in writer.done():
            yield s

    def _delta(self, i: int, out: RequestOutput, o: CompletionOutput) -> Optional[Delta]:
        key, finished = (i, o.index), o.finish_reason is not None
        track = self._tracks.get(key)
        if (track is not None and track.done) or (not o.text and not o.token_ids and not finished):
            return None  # after the choice's end, or nothing new
        first = track is None
        if first:
            track = self._tracks[key] = _Track(ReasoningStream(self.reasoning) if self.reasoning else None,
                                               tc.ToolStream(self.plan) if self.plan.active else None)
        self.completion_tokens += len(o.token_ids)
        track.done = finished
        thought, content, held = "", o.text, False
        if track.split is not None:
            track.token_ids.extend(o.token_ids)
            thought, content = track.split.feed(o.text, finished)
            held = not content and not finished
        tool_deltas, reason = None, o.finish_reason
        if track.tools is not None and not held:
            tool_deltas = track.tools.feed(content, finished)
            reason = tc.finish_reason(self.plan, track.tools.calls, reason)
        return Delta(i, out, o, first, thought, content, held, tool_deltas, reason)

    def reasoning_tokens(self, tokenizer, key: tuple[int, int] = (0, 0)) -> int:
        """How many of a streamed choice's tokens were reasoning (reasoning_token_count)."""
        track = self._tracks.get(key)
        if track is None or track.split is None:
            return 0
        thought, rest = self.reasoning.extract(track.split.text)
        return reasoning_token_count(tokenizer, track.token_ids, thought, rest)

