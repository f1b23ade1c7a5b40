"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenization, stop strings, logprobs).

It owns the front end's view of every request: a ``ParentRequest`` per request (its children's
RequestStates, n > 1 and best_of gathered into one RequestOutput) and the beam searches' records
(engine/beam_search.py); the core only knows child sequences and beam groups.

Stop strings are matched on the text as it grows, including across token boundaries; a match
finishes the request (the engine then aborts it in the scheduler so its blocks are freed).
While streaming, the last ``max_stop_len - 1`` characters are held back so a partial stop
string is never shown.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.core.contracts import EngineCoreOutput, Logprobs
from pagedllm.core.engine_request import EngineCoreRequest
from pagedllm.engine.best_of import pick_best
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    request_id: str
    parent_id: str
    index: int  # which of the parent's n outputs
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: Optional[IncrementalDetokenizer]
    text: str = ""
    sent_text_len: int = 0  # streaming: how much of text was already returned
    sent_token_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    scheduled_time: Optional[float] = None
    streams: bool = False  # its parent returns an output every step (not only when all its children end)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


OUTPUT_FINAL, OUTPUT_CUMULATIVE, OUTPUT_DELTA = "final", "cumulative", "delta"
_MAX_TOKEN_GAPS = 1 << 16  # take_token_gaps' bound between reads
logger = logging.getLogger(__name__)


@dataclass
class StepResults:
    outputs: list[RequestOutput]
    stopped: list[str]  # core ids a stop string finished
    failed: list[str]  # core ids whose output could not be processed


@dataclass
class ParentRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    child_ids: list[str]
    output_kind: str
    best_of: Optional[SamplingParams] = None  # best_of > n: the request's params (engine/best_of.py)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        from pagedllm.engine.beam_search import BeamRequests

        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.beams = BeamRequests(tokenizer, self)  # beam searches (one RequestOutput when each ends)
        self._token_gaps: Optional[list[float]] = None  # seconds between a request's outputs, once asked for

    # ---- requests ---------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.beams

    def num_unfinished(self) -> int:
        return len(self.parents) + len(self.beams)

    def add_parent(self, req: EngineCoreRequest, prompt: Optional[str], output_kind: str,
                   best_of: Optional[SamplingParams]) -> None:
        """Track a sampled request's children (before the core sees it)."""
        if req.beam is not None:
            self.beams.add(req, prompt)
            return
        child_ids = req.child_ids
        for i, cid in enumerate(child_ids):
            cp = req.child_params(i)
            detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, cp.skip_special_tokens)
                     if self.tokenizer is not None and cp.detokenize else None)
            self.add_request(RequestState(cid, req.request_id, i, prompt, req.prompt_token_ids, cp, detok,
                                          arrival_time=req.arrival_time,
                                          streams=output_kind != OUTPUT_FINAL and best_of is None))
        self.parents[req.request_id] = ParentRequest(req.request_id, prompt, req.prompt_token_ids, child_ids,
                                                     output_kind, best_of=best_of)

    def drop(self, request_id: str) -> None:
        """Forget a request that never reached the core."""
        parent = self.parents.pop(request_id, None)
        for cid in parent.child_ids if parent is not None else ():
            self.remove(cid)
        self.beams.drop(request_id)

    def core_ids(self, request_id: str) -> list[str]:
        """The core's request ids of a request (its children, or its beam group)."""
        if request_id in self.beams:
            return [request_id]
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def abort(self, request_id: str, core_outputs: list[EngineCoreOutput]) -> Optional[RequestOutput]:
        """Finish a request as aborted; its final RequestOutput (for metrics). ``core_outputs``:
        what the core returned for the abort (a beam group's live beams), if anything."""
        if request_id in self.beams:
            out = next((o for o in core_outputs if o.req_id == request_id), None)
            return self.beams.finish(out or EngineCoreOutput(request_id, [], finish_reason="abort"))
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for cid in parent.child_ids:
            st = self.states.get(cid)
            if st is not None and st.finish_reason is None:
                st.finish_reason = "abort"
        ro = None
        if all(c in self.states for c in parent.child_ids):
            ro = self._make_output(parent)  # removes the parent and its states
        self.drop(request_id)
        return ro

    def take_token_gaps(self) -> list[float]:
        """The gaps (seconds) between each request's consecutive outputs since the last call, one
        per output after a request's first (vLLM's inter-token latencies). Collected from the
        first call on; at most _MAX_TOKEN_GAPS are kept between calls."""
        gaps, self._token_gaps = self._token_gaps or [], []
        return gaps

    # ---- a step's outputs -------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], step_start: float) -> StepResults:
        """The step's RequestOutputs, the core ids a stop string finished and those that failed
        here (the caller finishes both in the core). Outputs of requests already finished here (a
        stop string, an abort the core has not applied yet) are dropped. A raise while processing
        one request's output (detokenizing, stop strings, logprob dicts, building its output)
        fails that request only (all its children), with finish reason "error"."""
        touched: dict[str, None] = {}  # parents with an output to build this step
        res = StepResults([], [], [])
        states, beams, now = self.states, self.beams.requests, time.monotonic()
        for out in outputs:
            is_beam = bool(beams) and out.req_id in beams
            try:
                if is_beam:  # a beam search ended: its beam_width best sequences
                    res.outputs.append(self.beams.finish(out))
                    continue
                st = states.get(out.req_id)
                if st is None or st.finish_reason is not None:
                    continue
                st, stopped_by_string = self.process(out, now)
                if out.finish_reason == "error" and len(self.parents[st.parent_id].child_ids) > 1:
                    self._fail_children(st.parent_id, res)  # its siblings stop too: the request has failed
                if st.scheduled_time is None:  # start of the step that first produced output (queue time metric)
                    st.scheduled_time = step_start
                if stopped_by_string:
                    res.stopped.append(out.req_id)
                if st.streams or st.finish_reason is not None:  # else its parent has nothing to return yet
                    touched[st.parent_id] = None
            except Exception:
                logger.exception("request %s: processing its output failed; it finishes with \"error\"", out.req_id)
                if is_beam:
                    res.failed.append(out.req_id)
                    res.outputs.append(self.beams.fail(out.req_id))
                elif out.req_id in self.states:
                    pid = self.states[out.req_id].parent_id
                    self._fail_children(pid, res)
                    touched[pid] = None
        for pid in touched:
            parent = self.parents.get(pid)
            if parent is None:
                continue
            try:
                ro = self._make_output(parent)
            except Exception:
                logger.exception("request %s: building its output failed; it finishes with \"error\"", pid)
                self._fail_children(pid, res)
                ro = self._error_output(parent)
            if ro is not None:
                res.outputs.append(ro)
        return res

    def _fail_children(self, parent_id: str, res: "StepResults") -> None:
        """One child's output could not be processed (or failed in the core): the whole request
        (all n children) ends with "error", here and (through ``res.failed``) in the core."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return
        res.failed.extend(parent.child_ids)
        for cid in parent.child_ids:
            st = self.states.get(cid)
            if st is not None:
                st.finish_reason, st.stop_reason = "error", None

    def _error_output(self, parent: ParentRequest) -> RequestOutput:
        """The final output of a failed request, built from nothing that could have raised."""
        self.drop(parent.request_id)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, None,
                             [CompletionOutput(i, "", [], None, None, "error") for i in range(len(parent.child_ids))],
                             True)

    def _make_output(self, parent: ParentRequest) -> Optional[RequestOutput]:
        states = [self.states[c] for c in parent.child_ids]
        finished = all(s.finished for s in states)
        if (parent.output_kind == OUTPUT_FINAL or parent.best_of is not None) and not finished:
            return None
        completions = [self.completion(s, delta=parent.output_kind == OUTPUT_DELTA) for s in states]
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
                "max_tokens": first.params.max_tokens,
                "num_preemptions": sum(s.num_preemptions for s in states),
            },
        )
        if finished:
            self.drop(parent.request_id)
        return ro

    # ---- one sequence -----------------------------------------------------------------------

    def add_request(self, state: RequestState) -> None:
        if state.params.logprobs is not None:
            state.logprobs = []
            state.cumulative_logprob = 0.0
        if state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] + [None] * (len(state.prompt_token_ids) - 1)
        self.states[state.request_id] = state

    def _token_text(self, tok: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])

    def logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
        out = []
        for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_rank):
            d: dict[int, Logprob] = {}
            for j, (tid, v) in enumerate(zip(ids, vals)):
                if tid in d:
                    continue
                d[tid] = Logprob(v, rank if j == 0 else j, self._token_text(tid))
            out.append(d)
        return out

    def process(self, out: EngineCoreOutput, now: Optional[float] = None) -> tuple[RequestState, bool]:
        """Apply one engine output. Returns (state, stopped_by_string): the caller must abort the
        request in the scheduler when a stop string finished it."""
        st = self.states[out.req_id]
        now = time.monotonic() if now is None else now
        st.num_cached_tokens = out.num_cached_tokens
        st.num_preemptions = out.num_preemptions
        if out.prompt_logprobs is not None and st.prompt_logprobs is not None:
            for j, d in enumerate(self.logprob_dicts(out.prompt_logprobs)):
                st.prompt_logprobs[1 + out.prompt_logprobs.start + j] = d
        if not out.new_token_ids:
            if out.finish_reason is not None:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            return st, False
        if st.first_token_time is None:
            st.first_token_time = now
        elif self._token_gaps is not None and len(self._token_gaps) < _MAX_TOKEN_GAPS:
            self._token_gaps.append(now - st.last_token_time)
        st.last_token_time = now
        st.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and st.logprobs is not None:
            for d, vals in zip(self.logprob_dicts(out.logprobs), out.logprobs.logprobs):
                st.logprobs.append(d)
                st.cumulative_logprob += vals[0]
        stopped_by_string = False
        if st.detok is not None:
            ids_for_text = out.new_token_ids
            token_stop = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            if token_stop and not st.params.include_stop_str_in_output:
                ids_for_text = ids_for_text[:-1]  # the stop token's text is not part of the output
            if st.params.stop and not token_stop and len(ids_for_text) > 1:
                stopped_by_string = self._step_to_stop(st, ids_for_text, out.finish_reason is not None)
            else:
                delta = st.detok.step(ids_for_text)
                if out.finish_reason is not None:
                    delta += st.detok.flush()
                st.text += delta
                if st.params.stop and not token_stop:
                    stopped_by_string = self._check_stop_strings(st, len(delta), len(st.token_ids))
        if stopped_by_string:
            return st, True
        if out.finish_reason is not None:
            st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
        return st, False

    def _step_to_stop(self, st: RequestState, ids: list[int], finishing: bool) -> bool:
        """Several tokens in one step (speculative decoding) under stop strings: detokenized one
        at a time; the token that completes a stop string is the last one kept (later tokens and
        their logprobs are dropped, as if they had never been generated)."""
        for j, tok in enumerate(ids):
            delta = st.detok.step([tok])
            if finishing and j == len(ids) - 1:
                delta += st.detok.flush()
            st.text += delta
            if self._check_stop_strings(st, len(delta), len(st.token_ids) - (len(ids) - 1 - j)):
                drop = len(ids) - 1 - j
                if drop:
                    dropped = st.token_ids[-drop:]
                    del st.token_ids[-drop:]
                    if st.logprobs is not None and len(st.logprobs) >= drop:
                        for t, d in zip(dropped, st.logprobs[-drop:]):
                            st.cumulative_logprob -= d[t].logprob
                        del st.logprobs[-drop:]
                return True
        return False

    @staticmethod
    def _check_stop_strings(st: RequestState, new_chars: int, num_tokens: int) -> bool:
        """Whether a stop string ends within the last ``new_chars`` characters (the text is cut
        there). Not before ``num_tokens`` (the output's tokens so far) reaches min_tokens, as with
        stop tokens: a stop string completed earlier is passed over for good (vLLM's rule)."""
        if num_tokens < st.params.min_tokens:
            return False
        max_len = st.params.max_stop_len
        search_from = max(0, len(st.text) - new_chars - max_len + 1)
        best: Optional[tuple[int, str]] = None
        for s in st.params.stop:
            idx = st.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        st.text = st.text[: idx + len(s)] if st.params.include_stop_str_in_output else st.text[:idx]
        st.finish_reason, st.stop_reason = "stop", s
        return True

    # ---- building results -------------------------------------------------------------------
    def completion(self, st: RequestState, delta: bool) -> CompletionOutput:
        """Cumulative output, or (delta=True) only what was not returned before (streaming)."""
        text = st.text
        if not st.finished and st.params.stop:
            hold = st.params.max_stop_len - 1
            text = text[: max(len(text) - hold, st.sent_text_len)] if hold > 0 else text
        if delta:
            out_text, out_ids = text[st.sent_text_len :], st.token_ids[st.sent_token_len :]
            lps = st.logprobs[st.sent_token_len :] if st.logprobs is not None else None
            st.sent_text_len, st.sent_token_len = len(text), len(st.token_ids)
        else:
            out_text, out_ids, lps = text, list(st.token_ids), st.logprobs
        return CompletionOutput(
            index=st.index,
            text=out_text,
            token_ids=out_ids,
            cumulative_logprob=st.cumulative_logprob,
            logprobs=lps,
            finish_reason=st.finish_reason,
            stop_reason=st.stop_reason,
        )

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
