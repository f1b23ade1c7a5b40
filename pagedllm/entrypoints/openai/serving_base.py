"""What every generating API shares on the way from a validated request to admitted engine
streams: the server's options, the model (or LoRA adapter) a request names, tokenising on a
worker thread, SamplingParams from the request's fields (the model's generation defaults for the
fields left unset), the output constraint's compile, the logprob volume bound, and the StreamSet.

Each check that refuses a request is written once, here or where the value is defined
(SamplingParams' own ranges, whose ValueError names the field: serving_errors.to_api_error);
the API adapters (serving_completions, serving_chat, responses) only map their request and
response shapes onto these steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Optional

from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai.beam import beam_search_params
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request, to_api_error
from pagedllm.entrypoints.openai.stream_set import StreamSet
from pagedllm.entrypoints.openai.structured import rename_field, request_constraint
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.limits import CompilePoolFullError, CompileTimeoutError, compile_timeout

logger = logging.getLogger("pagedllm.server")


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


class ServingBase:
    def __init__(self, engine: EngineClient, served_model_names: list[str], model_path: str,
                 options: Optional[ServingOptions] = None) -> None:
        self.engine = engine
        self.options = options or ServingOptions()
        self.live_streams: set[StreamSet] = set()
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.vocab_size = self.input_processor.vocab_size
        self.max_model_len = engine.max_model_len
        self.default_sampling_params: dict[str, Any] = dict(engine.default_sampling_params)
        self.served_model_names = list(served_model_names)
        self._accepted = set(served_model_names) | {model_path, model_path.rstrip("/").rsplit("/", 1)[-1]}
        self.loras = engine.lora_registry  # LoRA adapters by name (None without enable_lora)

    # ---- the model, the tokenizer ------------------------------------------------------------
    def lora_for(self, name: Optional[str]):
        """The LoRARequest a request's ``model`` names (None: the base model)."""
        if not name or self.loras is None or name in self._accepted:
            return None
        return self.loras.get(name)

    def check_model(self, name: Optional[str]) -> str:
        if name and name not in self._accepted and self.lora_for(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name or self.served_model_names[0]

    @property
    def reasoning_parser(self) -> Optional[ReasoningParser]:
        """The server's --reasoning-parser (None: none)."""
        name = self.options.reasoning_parser
        return get_reasoning_parser(name) if name else None

    def require_tokenizer(self, message: str, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, message, param=param)

    def check_text_length(self, text: str, param: str) -> None:
        """A text that could never fit max_model_len is refused before it is tokenised."""
        try:
            self.input_processor.check_text_length(text)
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None

    # ---- SamplingParams ------------------------------------------------------------------------
    def sampling_params(self, req, prompt_len: int, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None, aliases: Optional[dict[str, str]] = None,
                        best_of: Optional[int] = None, tool_choice=None) -> SamplingParams:
        """The request's SamplingParams (``aliases``: the request's names for SamplingParams
        fields, e.g. max_completion_tokens, so an error names the field the client sent).
        ``best_of`` (completions) and ``tool_choice`` (chat): the fields only one API has."""
        aliases = aliases or {}
        if req.use_beam_search:  # one beam group, n = beam width (entrypoints/openai/beam.py)
            return beam_search_params(req, max_tokens, logprobs, prompt_len, self.max_model_len,
                                      lambda msg, field: APIError(400, msg, param=aliases.get(field, field)),
                                      tool_choice)
        self._check_logprob_limits({"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}, aliases)
        kwargs = self._sampling_kwargs(req, prompt_len, max_tokens, best_of)
        kwargs.update(logit_bias=req.logit_bias or None, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      structured_outputs=request_constraint(req, bad_request)[0])
        if req.priority and self.engine.config.scheduling_policy != "priority":
            raise bad_request(f"priority {req.priority} needs the server started with --scheduling-policy priority "
                              "(as vLLM, a non-zero priority is refused under fcfs)", "priority")
        try:  # its own ranges (seed, logit_bias keys and values, token ids >= 0, ...): a 400 naming the field
            params = SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise to_api_error(e, aliases) from None
        self._check_vocab(params)
        self._check_context(prompt_len, kwargs["max_tokens"], aliases)
        return params

    def _check_vocab(self, params: SamplingParams) -> None:
        """Token ids the request names must be the model's (SamplingParams knows no vocabulary)."""
        if params.logit_bias and any(k >= self.vocab_size for k in params.logit_bias):
            raise bad_request(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if params.allowed_token_ids and params.allowed_token_ids[-1] >= self.vocab_size:  # sorted by SamplingParams
            raise bad_request(f"allowed_token_ids must be token ids in [0, {self.vocab_size})", "allowed_token_ids")

    def _check_logprob_limits(self, values: dict[str, Optional[int]], aliases: dict[str, str]) -> None:
        for name, value in values.items():
            if value is not None and value > self.options.max_logprobs:
                field = aliases.get(name, name)
                raise bad_request(f"{field} must be at most {self.options.max_logprobs} (the server's "
                                  f"--max-logprobs), got {value}", field)

    def _sampling_kwargs(self, req, prompt_len: int, max_tokens: Optional[int],
                         best_of: Optional[int]) -> dict[str, Any]:
        """SamplingParams' fields from the request; a field the request leaves unset takes the
        model's generation_config.json default, if any."""
        defaults = self.default_sampling_params

        def pick(name: str, fallback):
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        top_k = min(pick("top_k", 0), self.vocab_size)  # same meaning, and no integer overflow in the sampler
        if max_tokens is None and "max_tokens" in defaults:  # the model's max_new_tokens, within the context
            max_tokens = max(1, min(defaults["max_tokens"], self.max_model_len - prompt_len))
        return dict(
            n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=top_k,
            min_p=pick("min_p", 0.0), seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=pick("repetition_penalty", 1.0),
            skip_special_tokens=req.skip_special_tokens, best_of=best_of,
            bad_words=req.bad_words, allowed_token_ids=req.allowed_token_ids,
            spaces_between_special_tokens=req.spaces_between_special_tokens, extra_args=req.vllm_xargs,
        )

    def _check_context(self, prompt_len: int, max_tokens: Optional[int], aliases: dict[str, str]) -> None:
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or the completion length.",
                param=aliases.get("max_tokens", "max_tokens"), code="context_length_exceeded",
            )

    async def check_constraint(self, req, params: SamplingParams, field: Optional[str] = None) -> None:
        """Compile the request's output constraint on a worker thread (cached for the engine):
        a schema, regex or grammar that does not compile is a 400 naming the request field."""
        if params.structured_outputs is None:
            return
        field = field or request_constraint(req, bad_request)[1]
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
            raise bad_request(rename_field(str(e), field), field) from None
        except CompileTimeoutError as e:
            raise APIError(408, rename_field(str(e), field), param=field, code="compile_timeout") from None
        except CompilePoolFullError as e:
            raise APIError(429, str(e), param=field, code="compile_queue_full", headers={"Retry-After": "1"}) from None

    # ---- prompts, logprobs -----------------------------------------------------------------------
    async def process(self, prompt, param: str, truncate: Optional[int] = None,
                      add_special_tokens: bool = True) -> ProcessedPrompt:
        """Validate and tokenise a prompt on a worker thread (never on the event loop); the
        request's ``truncate`` (truncate_prompt_tokens) keeps the prompt's last N tokens, its
        ``add_special_tokens`` false (completions) tokenises a text prompt without BOS."""
        if truncate is not None and not (truncate >= 1 or truncate == -1):
            raise bad_request(f"truncate_prompt_tokens must be >= 1 or -1, got {truncate}", "truncate_prompt_tokens")
        if isinstance(prompt, str) and not add_special_tokens:
            self.require_tokenizer("text prompts need a tokenizer", param)
            self.check_text_length(prompt, param)
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=False)
            prompt = {"prompt_token_ids": list(ids), "prompt": prompt}
        try:
            p = await asyncio.to_thread(self.input_processor.process, prompt, truncate)
            return ProcessedPrompt(None if truncate is not None else p.text, p.token_ids, mm_features=p.mm_features)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
            raise APIError(400, str(e), param=param, code=code) from None

    @staticmethod
    def engine_prompt(req, ids: list[int], text: Optional[str] = None, mm_features: tuple = ()) -> ProcessedPrompt:
        """The engine's prompt (validated by process: not checked again): the token ids, the text,
        vLLM's cache_salt (a tenant's own prefix cache: the salt keys the first block, so the hash
        chain differs from everyone else's), the request's priority, its images."""
        return ProcessedPrompt(text, ids, req.cache_salt, req.priority or 0, mm_features)

    def check_logprob_volume(self, items: list[tuple[int, Any]], echo_logprobs: Optional[int],
                             prompt_logprobs: Optional[int]) -> None:
        """Refuse up front (400) a response whose logprob entries -- one per token and alternative,
        in every returned choice of every prompt -- would pass max_logprob_entries: generated
        tokens' logprobs, the prompt's (prompt_logprobs) and echo's (the prompt's, with logprobs)."""
        limit = self.engine.config.max_logprob_entries
        total, fields = 0, set()
        for prompt_len, params in items:
            n, logprobs = params.n, params.logprobs  # SamplingParams or BeamSearchParams (n: the beam width)
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

    @staticmethod
    def check_prompt_logprobs(req) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def prompt_logprobs(self, req, out: Optional[RequestOutput]):
        """vLLM's prompt_logprobs field, when the request asked for them."""
        if req.prompt_logprobs is None or out is None:
            return None
        return lp_format.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs,
                                         self.tokenizer)

    # ---- admission, shutdown -------------------------------------------------------------------
    def timeout(self, req, timeout: Optional[float]) -> Optional[float]:
        """The request's deadline in seconds: the body's ``timeout``, else the x-request-timeout
        header (``timeout``), else the server's default."""
        return req.timeout or timeout or self.options.request_timeout

    async def start(self, items, timeout: Optional[float] = None, model: Optional[str] = None) -> StreamSet:
        """Admit the engine requests ``items`` ((prompt, params, request id) each) as one StreamSet."""
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
