"""LLMEngine: the synchronous engine (add_request / abort_request / step).

A request with ``n > 1`` fans out into n child requests (seed + i each when seeded) that share
the prompt's KV blocks through the prefix cache; their outputs are gathered into one
RequestOutput.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.beam_search import BeamRequests, BeamSearchParams
from pagedllm.engine.best_of import child_params, pick_best, uses_best_of
from pagedllm.engine.core import EngineCore
from pagedllm.models.config_json import load_generation_defaults, load_hf_config
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.engine.structured_outputs import StructuredOutputs
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer
from pagedllm.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

OUTPUT_FINAL, OUTPUT_CUMULATIVE, OUTPUT_DELTA = "final", "cumulative", "delta"


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    child_ids: list[str]
    output_kind: str
    finished_children: set[str] = field(default_factory=set)
    best_of: Optional[SamplingParams] = None  # best_of > n: the request's params (engine/best_of.py)


def _eos_ids(model_dir: str, hf_config, tokenizer) -> list[int]:
    ids: list[int] = []
    try:  # generation_config.json read directly: importing transformers costs seconds
        import json
        import os

        with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids = [eos] if isinstance(eos, int) else list(eos)
    except Exception:
        pass
    if not ids:
        e = getattr(hf_config, "eos_token_id", None)
        if e is None and tokenizer is not None:
            e = tokenizer.eos_token_id
        if e is not None:
            ids = [e] if isinstance(e, int) else list(e)
    return ids


def _child_seed(seed: int, index: int) -> int:
    """seed + index, wrapped to stay a 64-bit signed integer."""
    return (seed + index + 2**63) % 2**64 - 2**63


class LLMEngine:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        self.config = config
        hf_config = load_hf_config(config.model)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self.core = EngineCore(config, hf_config)
        self.hf_config = hf_config
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = _eos_ids(config.model, hf_config, self.tokenizer)
        self.lora_registry = None  # the adapters this engine knows (enable_lora)
        if config.enable_lora:
            from pagedllm.lora.registry import LoRARegistry

            self.lora_registry = LoRARegistry(hf_config, config.max_lora_rank)
        if self.tokenizer is not None:  # constrained decoding (xgrammar is imported on first use)
            self.core.structured = StructuredOutputs(
                StructuredOutputManager(self.tokenizer, hf_config.vocab_size, self.eos_token_ids))
        # The model's recommended sampling defaults, for requests that leave those fields unset.
        self.default_sampling_params = load_generation_defaults(config.model, config.generation_config)
        if self.default_sampling_params:
            logger.info("default sampling parameters from the model's generation_config.json: %s (used where a "
                        "request leaves them unset; --generation-config vllm ignores them)",
                        self.default_sampling_params)
        self.input_processor = InputProcessor(self.tokenizer, hf_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beams = BeamRequests(self.tokenizer, self.output_processor, self.eos_token_ids)  # beam searches
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}
        self._ids = itertools.count()

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
    ) -> str:
        if isinstance(params, BeamSearchParams):
            return self._add_beam_search(request_id, prompt, params, arrival_time, lora_request)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.config.max_n:
            raise ValueError(f"n must be at most {self.config.max_n} (max_n), got {params.n}")
        if params.best_of is not None and params.best_of > self.config.max_n:
            raise ValueError(f"best_of must be at most {self.config.max_n} (max_n), got {params.best_of}")
        request_id = request_id or self.new_request_id()
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.input_processor.process(prompt, params.truncate_prompt_tokens)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # vLLM's prompt field
        priority = prompt.get("priority", 0) if isinstance(prompt, dict) else 0  # the server's request priority
        extra = {"priority": priority} if priority else {}
        lora = self.resolve_lora(lora_request)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        params = params.clone().with_eos(self.eos_token_ids)
        if params.bad_words:
            params.with_bad_words(self.tokenizer)
        best_of = params if uses_best_of(params) else None
        if best_of is not None:  # best_of children sampled; the n best returned when all are done
            params = child_params(params).clone(n=best_of.best_of)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        parent = _Parent(request_id, text, ids, child_ids, output_kind, best_of=best_of)
        added: list[str] = []
        try:
            for i, cid in enumerate(child_ids):
                cp = params if params.n == 1 else params.clone(seed=None if params.seed is None else _child_seed(params.seed, i))
                req = Request(cid, ids, cp, max_tokens=max_tokens, arrival_time=arrival_time, cache_salt=cache_salt,
                              lora=lora, **extra)
                self.core.add_request(req)
                added.append(cid)
                detok = (
                    IncrementalDetokenizer(self.tokenizer, ids, cp.skip_special_tokens)
                    if self.tokenizer is not None and cp.detokenize else None
                )
                self.output_processor.add_request(
                    RequestState(cid, request_id, i, text, ids, cp, detok, arrival_time=req.arrival_time)
                )
                self.child_to_parent[cid] = request_id
        except Exception:
            self.core.abort_requests(added)
            for cid in added:
                self.output_processor.remove(cid)
                self.child_to_parent.pop(cid, None)
            raise
        self.parents[request_id] = parent
        return request_id

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` now (cached for the request that follows):
        ValueError naming the field when it does not compile or xgrammar is missing."""
        if params.structured_outputs is None:
            return
        if self.core.structured is None:
            raise ValueError("structured_outputs needs the engine's tokenizer (the engine was started without one)")
        self.core.structured.manager.validate(params.structured_outputs)

    def resolve_lora(self, lora_request):
        """The adapter handle of a LoRARequest (checked on first sight; ValueError if it is bad or
        the engine runs without enable_lora); None for the base model."""
        if lora_request is None:
            return None
        if self.lora_registry is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        return self.lora_registry.resolve(lora_request)

    def _add_beam_search(self, request_id: Optional[str], prompt: PromptType, params: BeamSearchParams,
                         arrival_time: Optional[float], lora_request) -> str:
        """One beam group (engine/beam_search.py); its result comes once, when the search ends."""
        if params.beam_width > self.config.max_n:
            raise ValueError(f"beam_width must be at most {self.config.max_n} (max_n), got {params.beam_width}")
        if lora_request is not None:
            raise ValueError("beam search with a LoRA adapter (lora_request) is not supported")
        if params.beam_width > min(self.config.max_num_seqs, self.core.max_num_batched_tokens):
            raise ValueError(f"beam_width must be at most max_num_seqs and max_num_batched_tokens (the beams run "
                             f"as sequences of one step), got {params.beam_width}")
        request_id = request_id or self.new_request_id()
        if request_id in self.parents or request_id in self.beams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.input_processor.process(prompt)
        max_tokens = min(self.max_model_len - len(ids), params.max_tokens)
        bs = self.config.block_size
        need = params.beam_width * -(-(len(ids) + max_tokens) // bs)
        if need > self.core.num_blocks:  # W beams recomputed apart after a preemption must fit
            raise ValueError(f"beam_width x (prompt + max_tokens) needs up to {need} KV blocks, the cache has "
                             f"{self.core.num_blocks}: lower beam_width or max_tokens")
        self.core.add_request(self.beams.make_request(request_id, text, ids, params, max_tokens, arrival_time))
        return request_id

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Abort requests (their blocks are freed at once). Returns each aborted request's final
        RequestOutput (unfinished sequences with finish_reason "abort"), for metrics."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals: list[RequestOutput] = []
        for rid in request_ids:
            if rid in self.beams:
                self.core.abort_requests([rid])
                finals.append(self.beams.abort(rid))
                continue
            parent = self.parents.get(rid)
            if parent is None:
                continue
            self.core.abort_requests(parent.child_ids)
            for cid in parent.child_ids:
                st = self.output_processor.states.get(cid)
                if st is not None and st.finish_reason is None:
                    st.finish_reason = "abort"
            if all(c in self.output_processor.states for c in parent.child_ids):
                ro = self._make_output(parent)  # removes the parent and its states
                if ro is not None:
                    finals.append(ro)
            self.parents.pop(rid, None)
            for cid in parent.child_ids:
                self.output_processor.remove(cid)
                self.child_to_parent.pop(cid, None)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self.beams.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents) + len(self.beams.requests)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.monotonic()
        core_outputs = self.core.step()
        touched: dict[str, None] = {}
        stopped: list[str] = []
        beam_results: list[RequestOutput] = []
        for out in core_outputs:
            is_beam = out.req_id in self.beams
            try:  # detokenizing, stop strings, logprob dicts: a failure fails this request only
                if is_beam:  # a beam search ended: its beam_width best sequences
                    beam_results.append(self.beams.finish(out))
                    continue
                if out.req_id not in self.output_processor.states:
                    continue
                st, stopped_by_string = self.output_processor.process(out)
                if out.finish_reason == "error" and len(self.parents[st.parent_id].child_ids) > 1:
                    self._fail_children(out.req_id)  # its siblings stop too: the request has failed
                if st.scheduled_time is None:  # start of the step that first produced output (queue time metric)
                    st.scheduled_time = step_start
                if stopped_by_string:
                    stopped.append(out.req_id)
                touched[st.parent_id] = None
            except Exception:
                logger.exception("request %s: processing its output failed; it finishes with \"error\"", out.req_id)
                if is_beam:
                    self.core.abort_requests([out.req_id], RequestStatus.FINISHED_ERROR)
                    beam_results.append(self.beams.fail(out.req_id))
                else:
                    pid = self._fail_children(out.req_id)
                    if pid is not None:
                        touched[pid] = None
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        results = beam_results
        for pid in touched:
            try:
                ro = self._make_output(self.parents[pid])
            except Exception:
                logger.exception("request %s: building its output failed; it finishes with \"error\"", pid)
                self._fail_children(self.parents[pid].child_ids[0])
                ro = self._error_output(self.parents[pid])
            if ro is not None:
                results.append(ro)
        return results

    def _fail_children(self, child_id: str) -> Optional[str]:
        """One child's output could not be processed: the whole request (all n children) ends
        with "error" in the core and here. Returns its parent id (None if unknown)."""
        pid = self.child_to_parent.get(child_id)
        parent = self.parents.get(pid) if pid is not None else None
        if parent is None:
            return None
        self.core.abort_requests(parent.child_ids, RequestStatus.FINISHED_ERROR)
        for cid in parent.child_ids:
            st = self.output_processor.states.get(cid)
            if st is not None:
                st.finish_reason, st.stop_reason = "error", None
        return pid

    def _error_output(self, parent: _Parent) -> RequestOutput:
        """The final output of a failed request, built from nothing that could have raised."""
        for c in parent.child_ids:
            self.output_processor.remove(c)
            self.child_to_parent.pop(c, None)
        self.parents.pop(parent.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, None,
                             [CompletionOutput(i, "", [], None, None, "error") for i in range(len(parent.child_ids))],
                             True)

    def _make_output(self, parent: _Parent) -> Optional[RequestOutput]:
        states = [self.output_processor.states[c] for c in parent.child_ids]
        finished = all(s.finished for s in states)
        if (parent.output_kind == OUTPUT_FINAL or parent.best_of is not None) and not finished:
            return None
        completions = [self.output_processor.completion(s, delta=parent.output_kind == OUTPUT_DELTA) for s in states]
        if parent.best_of is not None:
            completions = pick_best(completions, parent.best_of)
        first = states[0]
        ro = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics={
                "arrival_time": first.arrival_time,
                "first_token_time": min((s.first_token_time for s in states if s.first_token_time), default=None),
                "last_token_time": max((s.last_token_time for s in states if s.last_token_time), default=None),
                "scheduled_time": min((s.scheduled_time for s in states if s.scheduled_time), default=None),
                "num_generated_tokens": sum(len(s.token_ids) for s in states),
            },
        )
        if finished:
            for c in parent.child_ids:
                self.output_processor.remove(c)
                self.child_to_parent.pop(c, None)
            del self.parents[parent.request_id]
        return ro

    # ---- stats ------------------------------------------------------------------------------
    def get_stats(self):
        return self.core.get_stats()

    @property
    def num_forward_tokens(self) -> int:
        return self.core.executor.num_forward_tokens

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
