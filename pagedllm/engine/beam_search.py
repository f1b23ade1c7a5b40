"""Beam search requests on the engine side: BeamSearchParams, the request's BeamGroup, its output.

The search itself runs inside the engine core (core/beam_group.py, core/beam_scheduling.py:
beams share KV blocks, copy-on-write, scored per step in one batched op); this module turns a
request into its group's root Request, gives the group a stop-string checker (the core has no
tokenizer), and turns the finished hypotheses into one RequestOutput whose ``outputs`` are the
``beam_width`` best sequences, best score first (``index`` = rank), each with its
``cumulative_logprob``. ``LLM.beam_search`` returns them in vLLM's BeamSearchOutput shape.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.contracts import BeamHypothesis, EngineCoreOutput
from pagedllm.core.engine_request import EngineCoreRequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401  (BeamSearchParams: re-exported)


@dataclass
class BeamSearchSequence:
    """vLLM's shape: ``tokens`` include the prompt."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float  # cum_logprob / generated_tokens ** length_penalty (what orders the beams)
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def make_stop_checker(tokenizer, stops: list[str]):
    """Does the text end with a stop string once ``token`` is appended? Decodes only a short tail
    (the stop strings' length in tokens, plus a few for multi-token characters)."""
    if not stops or tokenizer is None:
        return None
    window = max(len(s) for s in stops) + 4

    def check(output_ids: list[int], token: int) -> Optional[str]:
        tail = output_ids[-window:]
        before = tokenizer.decode(tail)
        after = tokenizer.decode(tail + [token])
        for s in stops:
            if s in after and s not in before:
                return s
        return None

    return check


@dataclass
class _BeamRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


def make_beam_group(req: EngineCoreRequest, tokenizer) -> BeamGroup:
    """The core's group of a beam request (its stop-string checker decodes with ``tokenizer``)."""
    spec = req.beam
    return BeamGroup(req.request_id, spec.beam_width, spec.length_penalty, spec.early_stopping,
                     make_stop_checker(tokenizer, req.sampling_params.stop))


class BeamRequests:
    """The front end's beam-search requests (the OutputProcessor owns one); the search itself is
    the core's BeamGroup, whose hypotheses come back in the group's final EngineCoreOutput."""

    def __init__(self, tokenizer, output_processor) -> None:
        self.tokenizer = tokenizer
        self.output_processor = output_processor  # its logprob-dict builder is shared
        self.requests: dict[str, _BeamRequest] = {}

    def add(self, req: EngineCoreRequest, prompt: Optional[str]) -> None:
        self.requests[req.request_id] = _BeamRequest(req.request_id, prompt, req.prompt_token_ids,
                                                     req.sampling_params, req.arrival_time)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def drop(self, request_id: str) -> None:
        """Forget a search that never reached the core."""
        self.requests.pop(request_id, None)

    def finish(self, out: EngineCoreOutput) -> RequestOutput:
        """The group's final output (its hypotheses, best first); the request is forgotten."""
        br = self.requests.pop(out.req_id)
        hyps = out.beam_hypotheses or []
        completions = [self._completion(i, h, br.params) for i, h in enumerate(hyps)]
        if out.finish_reason in ("abort", "error"):
            for c in completions:
                c.finish_reason = out.finish_reason
            if not completions:
                completions = [CompletionOutput(0, "", [], None, None, out.finish_reason)]
        return RequestOutput(br.request_id, br.prompt, br.prompt_token_ids, None, completions, True,
                             num_cached_tokens=out.num_cached_tokens,
                             metrics={"num_generated_tokens": sum(len(h.token_ids) for h in hyps),
                                      "arrival_time": br.arrival_time, "last_token_time": time.monotonic(),
                                      "beam_scores": [h.score for h in hyps]})

    def fail(self, request_id: str) -> RequestOutput:
        """The search's final output after a failure: finish reason "error", nothing decoded."""
        br = self.requests.pop(request_id, None)
        prompt, ids = (br.prompt, br.prompt_token_ids) if br is not None else (None, [])
        return RequestOutput(request_id, prompt, ids, None, [CompletionOutput(0, "", [], None, None, "error")], True)

    def _completion(self, index: int, h: BeamHypothesis, sp: SamplingParams) -> CompletionOutput:
        ids = list(h.token_ids)
        text = ""
        if self.tokenizer is not None:
            token_stop = h.finish_reason == "stop" and not isinstance(h.stop_reason, str)
            text_ids = ids[:-1] if token_stop and not sp.include_stop_str_in_output else ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens)
            if isinstance(h.stop_reason, str):
                cut = text.find(h.stop_reason)
                if cut != -1:
                    text = text[: cut + len(h.stop_reason)] if sp.include_stop_str_in_output else text[:cut]
        lps = None
        if h.logprobs is not None:
            lps = [d for row in h.logprobs for d in self.output_processor.logprob_dicts(row)]
        return CompletionOutput(index, text, ids, h.cum_logprob, lps, h.finish_reason, h.stop_reason)


def to_beam_search_output(ro: RequestOutput) -> BeamSearchOutput:
    scores = ro.metrics.get("beam_scores", [])
    return BeamSearchOutput([
        BeamSearchSequence(list(ro.prompt_token_ids) + list(c.token_ids), c.logprobs or [], c.cumulative_logprob or 0.0,
                           scores[i] if i < len(scores) else 0.0, c.text, c.finish_reason, c.stop_reason)
        for i, c in enumerate(ro.outputs)
    ])
