"""LLMEngine: the engine's front end (add_request / abort_request / step) over an EngineCoreClient.

The front end processes inputs and outputs; the core (in this process, or in its own:
engine/core_client.py) schedules and runs the model. ``add_request`` validates and tokenises a
request once (InputProcessor -> one EngineCoreRequest); ``step`` takes the core's next outputs
and turns them into RequestOutputs (OutputProcessor: detokenization, stop strings, n > 1 and
best_of gathered per request, beam results).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

from pagedllm.config import EngineConfig
from pagedllm.core.engine_request import EngineCoreRequest
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.best_of import uses_best_of
from pagedllm.engine.core_client import EngineCoreClient, make_engine_core_client
from pagedllm.engine.input_processor import InputProcessor, PromptType, eos_token_ids
from pagedllm.engine.output_processor import OUTPUT_CUMULATIVE, OUTPUT_DELTA, OUTPUT_FINAL, OutputProcessor  # noqa: F401
from pagedllm.models.config_json import load_generation_defaults, load_hf_config
from pagedllm.models.gguf import metadata_dir
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request the InputProcessor accepted: what the core gets, and what only the front end keeps."""

    request: EngineCoreRequest
    prompt_text: Optional[str]
    best_of: Optional[SamplingParams]  # best_of > n: the request's own params (the n best are picked)


class LLMEngine:
    """``multiprocess``: run the core in a process of its own (the server's default) instead of
    in this one; ``executor_factory``: EngineCore's (e.g. executor/simulated.py's SimulatedDevice)."""

    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False, multiprocess: bool = False,
                 executor_factory=None) -> None:
        self.config = config
        procs = ()
        if config.logits_processors:  # a bad name fails the start at once, naming it
            from pagedllm.sample.logits_processors import load_processor_classes

            procs = load_processor_classes(config.logits_processors)
        hf_config = load_hf_config(config.model)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(metadata_dir(config.tokenizer or config.model))
        self.hf_config = hf_config
        self.eos_token_ids = eos_token_ids(metadata_dir(config.model), hf_config, self.tokenizer)
        self.lora_registry = None  # the adapters this engine knows (enable_lora)
        if config.enable_lora:
            from pagedllm.lora.registry import LoRARegistry

            self.lora_registry = LoRARegistry(hf_config, config.max_lora_rank, config.max_registered_loras)
        self.client: EngineCoreClient = make_engine_core_client(config, hf_config, self.tokenizer, self.eos_token_ids,
                                                                skip_tokenizer_init, multiprocess, executor_factory)
        limits = self.client.limits
        self.max_model_len = limits.max_model_len
        # The model's recommended sampling defaults, for requests that leave those fields unset.
        self.default_sampling_params = load_generation_defaults(metadata_dir(config.model), config.generation_config)
        if self.default_sampling_params:
            logger.info("default sampling parameters from the model's generation_config.json: %s (used where a "
                        "request leaves them unset; --generation-config vllm ignores them)",
                        self.default_sampling_params)
        from pagedllm.multimodal.media import MediaSources
        from pagedllm.multimodal.processor import make_image_processor

        self.input_processor = InputProcessor(self.tokenizer, hf_config.vocab_size, self.max_model_len, limits,
                                              self.eos_token_ids, self.lora_registry, self._grammar_checker(),
                                              make_image_processor(config.model, hf_config, self.tokenizer,
                                                                   config.max_images_per_prompt),
                                              MediaSources.of_config(config), procs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def _grammar_checker(self):
        """What compiles a request's constraint up front: always the core's own manager (its
        compile cache then serves the request that follows), in this process or, through
        engine/core_compiles.py, in the core's: one process compiles and caches grammars."""
        if self.tokenizer is None:
            return None
        if self.client.in_process:
            return self.client.core.structured.manager
        from pagedllm.engine.core_compiles import CoreCompiles
        from pagedllm.structured_output.limits import CompileLimits

        return CoreCompiles(self.client, CompileLimits.from_config(self.config))

    @property
    def core(self):
        """The in-process EngineCore (tests and tools inspect it); AttributeError when the core
        runs in its own process."""
        if not self.client.in_process:
            raise AttributeError("the engine core runs in another process")
        return self.client.core

    # ---- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: SamplingParams,
        output_kind: str = OUTPUT_FINAL,
        arrival_time: Optional[float] = None,
        lora_request=None,
        deadline: Optional[float] = None,
    ) -> str:
        """``deadline``: time.monotonic() past which the core ends the request with "abort"."""
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.add_core_request(self.make_request(request_id, prompt, params, arrival_time, lora_request, deadline),
                              output_kind)
        return request_id

    def make_request(self, request_id: str, prompt: PromptType, params, arrival_time: Optional[float] = None,
                     lora_request=None, deadline: Optional[float] = None) -> "ProcessedRequest":
        """Validate and tokenise a request (ValueError naming the field); no state changes, so
        any thread may call it. ``deadline``: time.monotonic() past which the core ends it."""
        ip = self.input_processor
        if isinstance(params, BeamSearchParams):  # one beam group; its result comes once, when the search ends
            prompt, req = ip.make_beam_request(request_id, prompt, params, arrival_time, lora_request)
            best_of = None
        else:
            prompt, req = ip.make_request(request_id, prompt, params, arrival_time, lora_request)
            best_of = params if uses_best_of(params) else None
        if deadline is not None:
            req = replace(req, deadline=deadline)
        return ProcessedRequest(req, prompt.text, best_of)

    def add_core_request(self, processed: "ProcessedRequest", output_kind: str = OUTPUT_FINAL) -> None:
        """Track a made request and send it to the core."""
        req = processed.request
        if req.request_id in self.output_processor:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.output_processor.add_parent(req, processed.prompt_text, output_kind, processed.best_of)
        try:
            self.client.add_request(req)
        except BaseException:
            self.output_processor.drop(req.request_id)
            raise

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` now: ValueError naming the field when it does not
        compile or xgrammar is missing."""
        self.input_processor.check_structured_outputs(params)

    def resolve_lora(self, lora_request):
        """The adapter handle of a LoRARequest (checked on first sight; ValueError if it is bad or
        the engine runs without enable_lora); None for the base model."""
        return self.input_processor.resolve_lora(lora_request)

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Abort requests (their blocks are freed at once). Returns each aborted request's final
        RequestOutput (unfinished sequences with finish_reason "abort"), for metrics."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        op = self.output_processor
        known = [rid for rid in request_ids if rid in op]
        core_ids = [cid for rid in known for cid in op.core_ids(rid)]
        answered = self.client.abort_requests(core_ids) if core_ids else []
        finals = [op.abort(rid, answered) for rid in known]
        return [ro for ro in finals if ro is not None]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished() > 0

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished()

    # ---- the step ---------------------------------------------------------------------------
    def step(self, timeout: float = 0.5) -> list[RequestOutput]:
        """The core's next outputs as RequestOutputs (an in-process core runs one step; a core in
        its own process is waited for, up to ``timeout`` seconds)."""
        step_start = time.monotonic()
        core_outputs = self.client.get_output(timeout)
        self.last_core_outputs = core_outputs
        t0 = time.perf_counter()
        res = self.output_processor.process_outputs(core_outputs.outputs, step_start)
        if res.stopped:
            self.client.abort_requests(res.stopped, "stop")
        if res.failed:
            self.client.abort_requests(res.failed, "error")
        self.last_output_seconds = time.perf_counter() - t0
        return res.outputs

    # ---- stats ------------------------------------------------------------------------------
    def get_stats(self):
        return self.client.get_stats()

    @property
    def num_forward_tokens(self) -> int:
        return self.client.num_forward_tokens()

    def reset_prefix_cache(self) -> bool:
        return self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        self.client.shutdown()
