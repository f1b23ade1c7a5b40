"""Completions and chat completions over AsyncLLM: request -> SamplingParams -> engine streams ->
OpenAI responses (whole, or server-sent-event chunks).

Every prompt of a request is one engine request; a request's streams are merged (StreamSet) and
closed together, so a client that goes away aborts all of its engine requests. Admission errors
(bad input, full queue, dead engine) surface before any byte is sent, as HTTP errors. A request
past its deadline, or still running when a shutdown's drain time ends, is aborted and ends with
an error (an error event and ``[DONE]`` when streaming).

Tokenising and chat-template rendering run on worker threads (the light tokenizer releases the
GIL for long texts), bounded: a text that could never fit max_model_len is refused before it is
tokenised, and a chat template sent with a request is refused unless the server trusts them
(``--trust-request-chat-template``), then rendered in a TemplateSandbox (another process,
bounded in time, memory and output).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from pagedllm.engine.async_llm import (DEAD_MESSAGE, EngineDeadError, QueueFullError, RequestFailedError,
                                       sequences_of)
from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.engine.protocol import EngineClient
from pagedllm.structured_output.limits import CompilePoolFullError, CompileTimeoutError, compile_timeout
from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai.beam import beam_search_params, check_best_of
from pagedllm.entrypoints.openai import tool_calls as tc
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser
from pagedllm.entrypoints.openai.structured import rename_field, request_constraint
from pagedllm.entrypoints.request_id import request_id_var
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice, ChatChunks, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
    ChatStreamChoice, CompletionChoice, CompletionChunks, CompletionRequest, CompletionResponse,
    DeltaMessage, ErrorInfo, ErrorResponse, ImageURL, PromptTokensDetails, UsageInfo,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, token_id_key

logger = logging.getLogger("pagedllm.server")

_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
                  429: "queue_full", 500: "internal_error", 503: "unavailable"}



class APIError(Exception):
    """An error the client sees as ``{"error": {message, type, param, code}}`` with ``status``
    (and ``headers``, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _DEFAULT_CODES.get(status, "error")
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def _bad_request(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def to_api_error(e: BaseException, aliases: Optional[dict[str, str]] = None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):  # its text may hold internals (paths, ports, exceptions): logged only
        logger.error("engine dead: %s", e)
        return APIError(503, DEAD_MESSAGE, code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, CompileTimeoutError):
        return APIError(408, str(e), code="compile_timeout")
    if isinstance(e, CompilePoolFullError):
        return APIError(429, str(e), code="compile_queue_full", headers={"Retry-After": "1"})
    if isinstance(e, (ValueError, TypeError)):
        first = str(e).split(" ", 1)[0]
        param = (aliases or {}).get(first, first) if first in _PARAM_NAMES else None
        return APIError(400, str(e), param=param, code="invalid_value")
    return internal_error(e)


def internal_error(e: BaseException) -> APIError:
    """A 500 without internal details: the request id, with the traceback in the server log."""
    rid = request_id_var.get()
    logger.error("internal error (request id %s)", rid, exc_info=e)
    return APIError(500, f"internal server error; the server log has the details under request id {rid}",
                    code="internal_error", type="server_error")


class RequestTimeout(APIError):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request did not finish within its timeout of {seconds:g} s and was aborted "
                              "(set 'timeout' in the body or the x-request-timeout header to allow more)",
                         param="timeout", code="request_timeout")


class ShuttingDown(APIError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down and ended this request; retry on another replica",
                         code="shutting_down")


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """What the server lets requests do (from ServerArgs)."""

    trust_request_chat_template: bool = False
    template_sandbox: Any = None  # a TemplateSandbox, needed when request templates are trusted
    request_timeout: Optional[float] = None  # default deadline in seconds (None: none)
    chat_template: Optional[str] = None  # the server's --chat-template (replaces the model's)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (with tool_call_parser)
    tool_call_parser: Optional[str] = None  # hermes | llama3_json
    log_requests: bool = False  # --enable-log-requests: one line per engine request
    max_logprobs: int = 20  # --max-logprobs
    response_role: str = "assistant"  # --response-role
    reasoning_parser: Optional[str] = None  # --reasoning-parser: deepseek_r1 | qwen3


def sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


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


@dataclasses.dataclass
class _Choice:
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


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str], model_path: str,
                 options: Optional[ServingOptions] = None) -> None:
        self.engine = engine
        self.options = options or ServingOptions()
        self.live_streams: set[StreamSet] = set()
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.vocab_size = self.input_processor.vocab_size
        self.max_model_len = engine.max_model_len
        self.default_sampling_params: dict[str, Any] = dict(getattr(engine, "default_sampling_params", None) or {})
        self.served_model_names = list(served_model_names)
        self._accepted = set(served_model_names) | {model_path, model_path.rstrip("/").rsplit("/", 1)[-1]}
        self.loras = engine.lora_registry  # LoRA adapters by name (None without enable_lora)

    # ---- shared -----------------------------------------------------------------------------
    def lora_for(self, name: Optional[str]):
        """The LoRARequest a request's ``model`` names (None: the base model)."""
        if not name or self.loras is None or name in self._accepted:
            return None
        return self.loras.get(name)

    def check_model(self, name: Optional[str]) -> str:
        if name and name not in self._accepted and self.lora_for(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name or self.served_model_names[0]

    def sampling_params(self, req, prompt_len: int, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        aliases: Optional[dict[str, str]] = None) -> SamplingParams:
        if req.use_beam_search:  # one beam group, n = beam width (entrypoints/openai/beam.py)
            return beam_search_params(req, max_tokens, logprobs, prompt_len, self.max_model_len,
                                      lambda msg, field: APIError(400, msg, param=(aliases or {}).get(field, field)))
        bias = None
        if req.logit_bias:
            try:
                bias = {token_id_key(k): v for k, v in req.logit_bias.items()}
            except ValueError as e:
                raise APIError(400, str(e), param="logit_bias", code="invalid_value") from None
            if any(not 0 <= k < self.vocab_size for k in bias):
                raise APIError(400, f"logit_bias token ids must be in [0, {self.vocab_size})", param="logit_bias",
                               code="invalid_value")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > self.options.max_logprobs:
                field = (aliases or {}).get(name, name)
                raise APIError(400, f"{field} must be at most {self.options.max_logprobs} (the server's "
                                    f"--max-logprobs), got {value}", param=field, code="invalid_value")
        if req.seed is not None and not -(2**63) <= req.seed < 2**63:
            raise APIError(400, "seed must be a 64-bit signed integer", param="seed", code="invalid_value")
        # A field the request leaves unset takes the model's generation_config.json default, if any.
        defaults = self.default_sampling_params

        def pick(name: str, fallback):
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        top_k = pick("top_k", 0)
        if top_k > self.vocab_size:  # same meaning, and no integer overflow in the sampler
            top_k = self.vocab_size
        if max_tokens is None and "max_tokens" in defaults:  # the model's max_new_tokens, within the context
            max_tokens = max(1, min(defaults["max_tokens"], self.max_model_len - prompt_len))
        kwargs = dict(
            n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=top_k,
            min_p=pick("min_p", 0.0), seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, best_of=getattr(req, "best_of", None),
            structured_outputs=request_constraint(req, _bad_request)[0],
            bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
            spaces_between_special_tokens=req.spaces_between_special_tokens, extra_args=req.vllm_xargs,
        )
        if req.priority and getattr(self.engine.config, "scheduling_policy", "fcfs") != "priority":
            raise APIError(400, f"priority {req.priority} needs the server started with --scheduling-policy priority "
                                "(as vLLM, a non-zero priority is refused under fcfs)", param="priority",
                           code="invalid_value")
        if req.allowed_token_ids and any(not 0 <= t < self.vocab_size for t in req.allowed_token_ids):
            raise APIError(400, f"allowed_token_ids must be token ids in [0, {self.vocab_size})",
                           param="allowed_token_ids", code="invalid_value")
        try:
            params = SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise to_api_error(e, aliases) from None
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or the completion length.",
                param=(aliases or {}).get("max_tokens", "max_tokens"), code="context_length_exceeded",
            )
        return params

    async def _check_constraint(self, req, params: SamplingParams, field: Optional[str] = None) -> None:
        """Compile the request's output constraint on a worker thread (cached for the engine):
        a schema, regex or grammar that does not compile is a 400 naming the request field."""
        if params.structured_outputs is None:
            return
        field = field or request_constraint(req, _bad_request)[1]
        try:
            # the compile pool's own thread (in the engine core), never the default executor's; a
            # client that goes away cancels the await below, which withdraws the compile. Submitted
            # from a thread: sending a large constraint to the core's pipe may wait for the core
            fut = await asyncio.to_thread(self.engine.compile_structured_outputs, params)
            if fut is not None:
                limit = self.engine.config.structured_compile_timeout
                try:
                    await asyncio.wait_for(asyncio.wrap_future(fut), limit)
                except asyncio.TimeoutError:
                    raise compile_timeout(params.structured_outputs, limit) from None
        except ValueError as e:
            raise APIError(400, rename_field(str(e), field), param=field, code="invalid_value") from None
        except CompileTimeoutError as e:
            raise APIError(408, rename_field(str(e), field), param=field, code="compile_timeout") from None
        except CompilePoolFullError as e:
            raise APIError(429, str(e), param=field, code="compile_queue_full", headers={"Retry-After": "1"}) from None

    async def _process(self, prompt, param: str, req=None) -> ProcessedPrompt:
        """Validate and tokenise a prompt on a worker thread (never on the event loop); ``req``'s
        truncate_prompt_tokens keeps the prompt's last N tokens, its add_special_tokens false
        tokenises a text prompt without BOS."""
        truncate = getattr(req, "truncate_prompt_tokens", None)
        if truncate is not None and not (truncate >= 1 or truncate == -1):
            raise APIError(400, f"truncate_prompt_tokens must be >= 1 or -1, got {truncate}",
                           param="truncate_prompt_tokens", code="invalid_value")
        if isinstance(prompt, str) and req is not None and not getattr(req, "add_special_tokens", True):
            if self.tokenizer is None:
                raise APIError(400, "text prompts need a tokenizer", param=param)
            try:
                self.input_processor.check_text_length(prompt)
            except ValueError as e:
                raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=False)
            prompt = {"prompt_token_ids": list(ids), "prompt": prompt}
        try:
            p = await asyncio.to_thread(self.input_processor.process, prompt, truncate)
            return ProcessedPrompt(None if truncate is not None else p.text, p.token_ids, mm_features=p.mm_features)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
            raise APIError(400, str(e), param=param, code=code) from None

    def _timeout(self, req, timeout: Optional[float]) -> Optional[float]:
        """The request's deadline in seconds: the body's ``timeout``, else the x-request-timeout
        header (``timeout``), else the server's default."""
        return req.timeout or timeout or self.options.request_timeout

    async def _start(self, items, timeout: Optional[float] = None, model: Optional[str] = None) -> StreamSet:
        if self.options.log_requests:
            for prompt, params, rid in items:
                logger.info("request %s: model %s, %d prompt tokens, %s", rid, model,
                            len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.token_ids), params)
        try:
            return await StreamSet(self.engine, items, timeout, self.live_streams, self.lora_for(model)).start()
        except Exception as e:
            raise to_api_error(e) from None

    def end_all(self, error: BaseException) -> int:
        """End every open request with ``error`` (shutdown); returns how many there were."""
        streams = list(self.live_streams)
        for st in streams:
            st.fail(error)
        return len(streams)

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    @staticmethod
    def _error_chunk(e: BaseException) -> str:
        return sse(to_api_error(e).body())

    # ---- /v1/completions --------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    async def create_completion(self, req: CompletionRequest, timeout: Optional[float] = None):
        model = self.check_model(req.model)
        if req.max_tokens == 0:  # vLLM's prompt scoring: echo the prompt (with its logprobs), generate nothing
            if not req.echo:
                raise APIError(400, "max_tokens 0 needs echo (it scores the prompt)", param="max_tokens",
                               code="invalid_value")
            if req.stream or req.n != 1 or req.use_beam_search or (req.best_of or 1) > 1:
                raise APIError(400, "max_tokens 0 (prompt scoring) is not available with stream, n > 1, best_of or "
                                    "beam search", param="max_tokens", code="invalid_value")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        check_best_of(req, lambda msg, field: APIError(400, msg, param=field))
        if req.echo and req.logprobs is not None and self.tokenizer is None:
            raise APIError(400, "echo with logprobs needs a tokenizer", param="echo")
        self._check_prompt_logprobs(req)
        prompts = [await self._process(p, "prompt", req) for p in self._completion_prompts(req.prompt)]
        rid = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        # The engine computes the prompt's top-N once: N the larger of prompt_logprobs and echo's logprobs.
        asked = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
        prompt_n = max(asked) if asked else None
        items = []
        for i, (text, ids) in enumerate(prompts):
            if text is None and req.echo and self.tokenizer is not None:
                text = self.tokenizer.decode(ids)
            prompts[i] = (text, ids)
            params = self.sampling_params(req, len(ids), req.max_tokens or (None if req.max_tokens is None else 1),
                                          req.logprobs, prompt_n)
            items.append((self._engine_prompt(req, ids, text), params, f"{rid}-{i}"))
        self._check_logprob_volume([(len(ids), p) for (_, p, _), (_, ids) in zip(items, prompts)],
                                   req.logprobs if req.echo else None, req.prompt_logprobs)
        if items:
            await self._check_constraint(req, items[0][1])
        streams = await self._start(items, self._timeout(req, timeout), model)
        if req.stream:
            return streams, self._completion_stream(req, streams, rid, model, prompts)
        return await self._completion_full(req, streams, rid, model, prompts)

    @staticmethod
    def _engine_prompt(req, ids: list[int], text: Optional[str] = None, mm_features: tuple = ()) -> ProcessedPrompt:
        """The engine's prompt (validated by _process: not checked again): the token ids, the text,
        vLLM's cache_salt (a tenant's own prefix cache: the salt keys the first block, so the hash
        chain differs from everyone else's), the request's priority, its images."""
        return ProcessedPrompt(text, ids, req.cache_salt, req.priority or 0, mm_features)

    def _check_logprob_volume(self, items: list[tuple[int, Any]], echo_logprobs: Optional[int],
                              prompt_logprobs: Optional[int]) -> None:
        """Refuse up front (400) a response whose logprob entries -- one per token and alternative,
        in every returned choice of every prompt -- would pass max_logprob_entries: generated
        tokens' logprobs, the prompt's (prompt_logprobs) and echo's (the prompt's, with logprobs)."""
        limit = self.engine.config.max_logprob_entries
        total, fields = 0, set()
        for prompt_len, params in items:
            n = getattr(params, "n", 1)
            logprobs = getattr(params, "logprobs", None)
            if logprobs is not None:
                max_tokens = params.max_tokens or max(self.max_model_len - prompt_len, 0)
                total += n * max_tokens * (logprobs + 1)
                fields.add("logprobs")
            for name, k in (("echo", echo_logprobs), ("prompt_logprobs", prompt_logprobs)):
                if k is not None:
                    total += n * prompt_len * (k + 1)
                    fields.add(name)
        if total > limit:
            names = " x ".join(sorted(fields | {"n"}))
            raise APIError(400, f"this request would return up to {total} logprob entries ({names}, over every "
                                f"prompt and choice), over the limit of {limit} (max_logprob_entries): lower n, "
                                "max_tokens, logprobs or prompt_logprobs", param=sorted(fields)[0],
                           code="response_too_large")

    def _echo_logprobs(self, out: RequestOutput, n: Optional[int]):
        if n is None:
            return None
        return lp_format.completion_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.tokenizer, n)

    @staticmethod
    def _check_prompt_logprobs(req) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs",
                           code="invalid_value")

    def _prompt_logprobs(self, req, out: Optional[RequestOutput]):
        """vLLM's prompt_logprobs field, when the request asked for them."""
        if req.prompt_logprobs is None or out is None:
            return None
        return lp_format.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs,
                                         self.tokenizer)

    async def _completion_full(self, req, streams: StreamSet, rid, model, prompts) -> CompletionResponse:
        choices: dict[tuple[int, int], _Choice] = {}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in streams:
                last[i] = out
                for o in out.outputs:
                    choices.setdefault((i, o.index), _Choice()).add(o)
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            streams.close()
        result, completion_tokens = [], 0
        for (i, k), c in sorted(choices.items()):
            if req.max_tokens == 0:  # scoring: the one token generated is not part of the answer
                c = _Choice(finish_reason="length")
            text, lps = "".join(c.text), None
            prefix = (prompts[i][0] or "") if req.echo else ""
            if req.logprobs is not None:
                lps = lp_format.completion_logprobs(c.token_ids, c.logprobs, self.tokenizer, len(prefix))
            if req.echo:
                text = prefix + text
                lps = lp_format.prepend(self._echo_logprobs(last[i], req.logprobs), lps)
            completion_tokens += len(c.token_ids)
            ids = (prompts[i][1], c.token_ids) if req.return_token_ids else (None, None)
            result.append(CompletionChoice(index=i * req.n + k, text=text, logprobs=lps,
                                           finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                           prompt_logprobs=self._prompt_logprobs(req, last.get(i)),
                                           prompt_token_ids=ids[0], token_ids=ids[1]))
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        cached = sum(o.num_cached_tokens for o in last.values())
        return CompletionResponse(id=rid, model=model, choices=result,
                                  usage=self._usage(prompt_tokens, completion_tokens, cached))

    async def _completion_stream(self, req, streams: StreamSet, rid, model, prompts) -> AsyncIterator[str]:
        done, sent, ntok, cached = set(), {}, 0, {}  # sent: characters streamed per choice
        chunks = CompletionChunks(rid, model)
        usage_each = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        try:
            async for i, out in streams:
                cached[i] = out.num_cached_tokens
                for o in out.outputs:
                    key = (i, o.index)
                    if key in done or (not o.text and not o.token_ids and o.finish_reason is None):
                        continue
                    first = key not in sent
                    prefix = (prompts[i][0] or "") if req.echo and first else ""
                    text, lps = prefix + o.text, None
                    if req.logprobs is not None:
                        lps = lp_format.completion_logprobs(o.token_ids, o.logprobs or [], self.tokenizer,
                                                            sent.get(key, 0) + len(prefix))
                    if prefix or (req.echo and first):
                        lps = lp_format.prepend(self._echo_logprobs(out, req.logprobs), lps)
                    sent[key] = sent.get(key, 0) + len(text)
                    ntok += len(o.token_ids)
                    if o.finish_reason is not None:
                        done.add(key)
                    if lps is None and not req.return_token_ids and not usage_each:  # the usual chunk
                        yield chunks.text(i * req.n + o.index, text, o.finish_reason, o.stop_reason)
                        continue
                    choice = CompletionChoice(index=i * req.n + o.index, text=text, logprobs=lps,
                                              finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                    if req.return_token_ids:
                        choice.token_ids = list(o.token_ids)
                        choice.prompt_token_ids = prompts[i][1] if first else None
                    usage = None
                    if usage_each:
                        usage = self._usage(sum(len(ids) for _, ids in prompts), ntok, sum(cached.values()))
                    yield chunks.model_chunk([choice], usage)
            if req.stream_options and req.stream_options.include_usage:
                usage = self._usage(sum(len(ids) for _, ids in prompts), ntok, sum(cached.values()))
                yield chunks.model_chunk([], usage)
        except Exception as e:
            yield self._error_chunk(e)
        finally:
            streams.close()
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def _chat_prompt(self, req: ChatCompletionRequest, tools: Optional[list] = None,
                           images: Optional[list] = None) -> list[int]:
        """The rendered conversation's token ids; ``images`` (a list) receives the images of its
        image_url parts, in prompt order (each part's text is the model's image placeholder)."""
        if not req.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages", code="invalid_value")
        if self.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer", param="messages")
        contents = [m.content for m in req.messages]
        if any(isinstance(c, list) for c in contents):  # images are decoded (and fetched) off the event loop
            args = (contents, images if images is not None else [])
            if _names_remote_image(contents):  # in threads of their own: a slow host never starves tokenizing
                from pagedllm.multimodal.media import fetch_pool

                contents = await asyncio.get_running_loop().run_in_executor(fetch_pool(), self._flatten_contents,
                                                                            *args)
            else:
                contents = await asyncio.to_thread(self._flatten_contents, *args)
        messages = [tc.template_message(m, c or "") for m, c in zip(req.messages, contents)]
        from pagedllm.tokenizer.chat_template import TemplateLimitError
        from pagedllm.tokenizer.tokenizer import apply_chat_template, render_request_template

        limit = self.input_processor.max_prompt_chars
        if limit and sum(len(m["content"]) for m in messages) > limit:
            raise APIError(400, f"the messages hold more than the {limit} characters that max_model_len "
                                f"({self.max_model_len} tokens) could ever hold", param="messages",
                           code="context_length_exceeded")
        kwargs = self._template_kwargs(getattr(req, "chat_template_kwargs", None))
        if getattr(req, "continue_final_message", False):
            if req.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                                    "add_generation_prompt false to continue the final message)",
                               param="continue_final_message", code="invalid_value")
            if req.messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message needs an assistant message last",
                               param="continue_final_message", code="invalid_value")
            kwargs["continue_final_message"] = True
        if getattr(req, "add_special_tokens", False):
            kwargs["add_special_tokens"] = True
        if getattr(req, "documents", None) is not None:
            kwargs["documents"] = req.documents
        template = getattr(req, "chat_template", None)
        if template is not None:
            if not self.options.trust_request_chat_template or self.options.template_sandbox is None:
                raise APIError(400, "chat_template in a request is not allowed on this server (the server's "
                                    "--trust-request-chat-template allows it)", param="chat_template",
                               code="chat_template_not_allowed")
            try:
                return await asyncio.to_thread(render_request_template, self.tokenizer,
                                               self.options.template_sandbox, template, messages,
                                               req.add_generation_prompt, tools=tools, **kwargs)
            except TemplateLimitError as e:
                raise APIError(400, f"the chat template exceeded its limits: {e}", param="chat_template",
                               code="chat_template_limit") from None
            except Exception as e:  # template errors are caused by the input
                raise APIError(400, f"could not apply the chat template: {e}", param="chat_template") from None
        try:
            return await asyncio.to_thread(apply_chat_template, self.tokenizer, messages, req.add_generation_prompt,
                                           self.options.chat_template, tools=tools, **kwargs)
        except TemplateLimitError as e:
            raise APIError(400, f"the chat template exceeded its limits: {e}", param="messages",
                           code="chat_template_limit") from None
        except Exception as e:  # template errors are caused by the input
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None

    def _flatten_contents(self, contents: list, images: list) -> list:
        from pagedllm.multimodal.chat_content import ContentError, flatten_content

        processor = self.input_processor.images
        placeholder = processor.placeholder if processor is not None else None
        try:
            return [flatten_content([p.model_dump(exclude_none=True) for p in c], placeholder, images,
                                    self.input_processor.media, f"messages[{i}].content",
                                    self.engine.config.max_images_per_prompt)
                    if isinstance(c, list) else c for i, c in enumerate(contents)]
        except ContentError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    @staticmethod
    def _template_kwargs(kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
        """chat_template_kwargs: extra template variables; the ones the renderer sets itself and
        transformers' own apply_chat_template parameters are refused, naming the key."""
        from pagedllm.tokenizer.chat_template import RESERVED_TEMPLATE_KWARGS

        for key in kwargs or {}:
            if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
                why = "is set by the server" if key in RESERVED_TEMPLATE_KWARGS else "is not a template variable name"
                raise APIError(400, f"chat_template_kwargs: {key!r} {why}", param=f"chat_template_kwargs.{key}",
                               code="invalid_value")
        return dict(kwargs or {})

    async def create_chat_completion(self, req: ChatCompletionRequest, timeout: Optional[float] = None):
        streams, rid, model, prompt_len, plan = await self.start_chat(req, timeout)
        if req.stream:
            return streams, self._chat_stream(req, streams, rid, model, prompt_len, plan)
        return await self._chat_full(req, streams, rid, model, prompt_len, plan)

    async def start_chat(self, req: ChatCompletionRequest, timeout: Optional[float] = None, request_id: Optional[str] = None):
        """Validate, render and admit a chat request: (streams, id, model name, prompt length, tool
        plan). /v1/chat/completions and /v1/responses both start their generations here."""
        model = self.check_model(req.model)
        max_tools = self.engine.config.max_tools
        if req.tools and len(req.tools) > max_tools:  # each is rendered into the prompt and may become a grammar
            raise _bad_request(f"tools has {len(req.tools)} entries, over the limit of {max_tools} (max_tools)", "tools")
        plan = tc.plan_tools(req, self.options.enable_auto_tool_choice, self.options.tool_call_parser, _bad_request)
        if req.mm_processor_kwargs and self.input_processor.images is not None:
            raise APIError(400, f"mm_processor_kwargs ({', '.join(sorted(map(str, req.mm_processor_kwargs)))}): this "
                                "server's image preprocessing takes no per-request options (it resizes and crops as "
                                "the checkpoint's preprocessor config says)", param="mm_processor_kwargs",
                           code="unsupported_field")
        images: list = []
        prompt: dict[str, Any] = {"prompt_token_ids": await self._chat_prompt(req, plan.tools, images)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        processed = await self._process(prompt, "messages", req)
        ids = processed.token_ids
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self._check_prompt_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        aliases = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        params = self.sampling_params(req, len(ids), max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      req.prompt_logprobs, aliases=aliases)
        self._check_logprob_volume([(len(ids), params)], None, req.prompt_logprobs)
        if getattr(plan.parser, "KEEPS_SPECIAL_TOKENS", False):  # its markers are special tokens (vLLM's parsers
            params.skip_special_tokens = False                   # turn skip_special_tokens off for them too)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise _bad_request(f"tool_choice {plan.mode!r} constrains the output, and so does "
                                   f"{request_constraint(req, _bad_request)[1]}: pass one", "tool_choice")
            params.structured_outputs = plan.constraint
        thinking = self._reasoning_parser()
        if thinking is not None and params.structured_outputs is not None:  # the answer is constrained, not the reasoning
            params.structured_outputs.reasoning_tags = thinking.tags
        await self._check_constraint(req, params, "tools" if plan.constraint is not None else None)
        rid = request_id or f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        streams = await self._start([(self._engine_prompt(req, ids, mm_features=processed.mm_features), params, rid)],
                                    self._timeout(req, timeout), model)
        return streams, rid, model, len(ids), plan

    def _chat_lps(self, req, token_ids, logprobs):
        if not req.logprobs:
            return None
        return lp_format.chat_logprobs(token_ids, logprobs or [], req.top_logprobs or 0, self.tokenizer)

    async def _chat_full(self, req, streams: StreamSet, rid, model, prompt_len, plan=None) -> ChatCompletionResponse:
        choices: dict[int, _Choice] = {}
        cached, last = 0, None
        try:
            async for _, out in streams:
                cached, last = out.num_cached_tokens, out
                for o in out.outputs:
                    choices.setdefault(o.index, _Choice()).add(o)
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            streams.close()
        result, echo, thinking = [], self._chat_echo(req), self._reasoning_parser()
        for k, c in sorted(choices.items()):
            text, thought = "".join(c.text), None
            if thinking is not None:  # --reasoning-parser: the reasoning apart, the rest is the reply
                thought, text = thinking.extract(text)
            content, calls = tc.parse_output(plan or tc.ToolPlan(), text or "")
            if thinking is not None and not text:
                content = None
            if echo and (content is not None or not calls):
                content = echo + (content or "")
            result.append(ChatChoice(index=k, message=ChatMessage(role=self.options.response_role, content=content,
                                                                  tool_calls=tc.tool_calls(calls),
                                                                  reasoning_content=thought),
                                     logprobs=self._chat_lps(req, c.token_ids, c.logprobs),
                                     finish_reason=tc.finish_reason(plan or tc.ToolPlan(), calls, c.finish_reason),
                                     stop_reason=c.stop_reason, token_ids=c.token_ids if req.return_token_ids else None))
        ntok = sum(len(c.token_ids) for c in choices.values())
        return ChatCompletionResponse(id=rid, model=model, choices=result, usage=self._usage(prompt_len, ntok, cached),
                                      prompt_logprobs=self._prompt_logprobs(req, last),
                                      prompt_token_ids=(last.prompt_token_ids if req.return_token_ids and last else None))

    def _reasoning_parser(self):
        name = self.options.reasoning_parser
        return get_reasoning_parser(name) if name else None

    @staticmethod
    def _chat_echo(req) -> str:
        """vLLM's chat echo: the reply starts with the final message's content when that message is
        the assistant's (the one continue_final_message continues)."""
        if not req.echo or req.messages[-1].role != "assistant":
            return ""
        content = req.messages[-1].content
        if isinstance(content, list):
            content = "\n".join(p.text or "" for p in content)
        return content or ""

    async def _chat_stream(self, req, streams: StreamSet, rid, model, prompt_len, plan=None) -> AsyncIterator[str]:
        done, ntok, cached = set(), 0, 0
        tools = {k: tc.ToolStream(plan) for k in range(req.n)} if plan is not None and plan.active else None
        thinking = self._reasoning_parser()
        reasoning = {k: ReasoningStream(thinking) for k in range(req.n)} if thinking is not None else None
        role_sent = False
        chunks = ChatChunks(rid, model)
        usage_each = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def usage_now() -> Optional[UsageInfo]:  # continuous_usage_stats: on every chunk, as vLLM's
            return self._usage(prompt_len, ntok, cached) if usage_each else None

        try:
            async for _, out in streams:
                cached = out.num_cached_tokens
                if not role_sent:  # with the first output (after prefill, as vLLM): TTFT is measured right
                    role_sent = True
                    for k in range(req.n):
                        choice = ChatStreamChoice(index=k, delta=DeltaMessage(role=self.options.response_role,
                                                                              content=""))
                        yield chunks.model_chunk(
                            [choice], usage_now(),
                            prompt_token_ids=out.prompt_token_ids if req.return_token_ids and k == 0 else None)
                        if self._chat_echo(req):
                            choice = ChatStreamChoice(index=k, delta=DeltaMessage(content=self._chat_echo(req)))
                            yield chunks.model_chunk([choice], usage_now())
                for o in out.outputs:
                    if o.index in done or (not o.text and not o.token_ids and o.finish_reason is None):
                        continue
                    ntok += len(o.token_ids)
                    if o.finish_reason is not None:
                        done.add(o.index)
                    text = o.text
                    if reasoning is not None:  # --reasoning-parser: reasoning_content deltas first
                        thought, text = reasoning[o.index].feed(o.text, o.finish_reason is not None)
                        if thought:
                            yield chunks.model_chunk([ChatStreamChoice(
                                index=o.index, delta=DeltaMessage(reasoning_content=thought))], usage_now())
                        if not text and o.finish_reason is None:
                            continue
                    if tools is not None:  # tool calls: content and tool_calls deltas, then the finish
                        for delta in tools[o.index].feed(text, o.finish_reason is not None):
                            yield chunks.model_chunk([ChatStreamChoice(index=o.index, delta=delta)], usage_now())
                        if o.finish_reason is None:
                            continue
                        reason = tc.finish_reason(plan, tools[o.index].calls, o.finish_reason)
                        choice = ChatStreamChoice(index=o.index, delta=DeltaMessage(), finish_reason=reason,
                                                  stop_reason=o.stop_reason)
                        yield chunks.model_chunk([choice], usage_now())
                        continue
                    if not req.logprobs and not req.return_token_ids and not usage_each:  # the usual chunk
                        yield chunks.content(o.index, text, o.finish_reason, o.stop_reason)
                        continue
                    choice = ChatStreamChoice(index=o.index, delta=DeltaMessage(content=text),
                                              logprobs=self._chat_lps(req, o.token_ids, o.logprobs),
                                              finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                              token_ids=list(o.token_ids) if req.return_token_ids else None)
                    yield chunks.model_chunk([choice], usage_now())
            if req.stream_options and req.stream_options.include_usage:
                usage = self._usage(prompt_len, ntok, cached)
                yield chunks.model_chunk([], usage)
        except Exception as e:
            yield self._error_chunk(e)
        finally:
            streams.close()
        yield "data: [DONE]\n\n"

    # ---- /tokenize, /detokenize -------------------------------------------------------------
    async def tokenize(self, req) -> list[int]:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", param="prompt")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            try:
                self.input_processor.check_text_length(req.prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
            return list(await asyncio.to_thread(self.tokenizer.encode, req.prompt,
                                                add_special_tokens=req.add_special_tokens))
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=req.chat_template_kwargs)
        return await self._chat_prompt(chat)

    def detokenize(self, req) -> str:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer", param="tokens")
        if any(not 0 <= t < self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param="tokens", code="invalid_value")
        return self.tokenizer.decode(req.tokens)


def _names_remote_image(contents: list) -> bool:
    """Whether a message's content parts name an http(s) image URL."""
    from pagedllm.multimodal.media import is_remote_url

    return any(is_remote_url(p.image_url.url if isinstance(p.image_url, ImageURL) else p.image_url)
               for c in contents if isinstance(c, list) for p in c)
