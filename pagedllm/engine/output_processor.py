"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenization, stop strings, logprobs).

Stop strings are matched on the text as it grows, including across token boundaries; a match
finishes the request (the engine then aborts it in the scheduler so its blocks are freed).
While streaming, the last ``max_stop_len - 1`` characters are held back so a partial stop
string is never shown.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.core.contracts import EngineCoreOutput, Logprobs
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs
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
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    scheduled_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

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

    def _logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
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
        if out.prompt_logprobs is not None and st.prompt_logprobs is not None:
            for j, d in enumerate(self._logprob_dicts(out.prompt_logprobs)):
                st.prompt_logprobs[1 + out.prompt_logprobs.start + j] = d
        if not out.new_token_ids:
            if out.finish_reason is not None:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            return st, False
        if st.first_token_time is None:
            st.first_token_time = now
        st.last_token_time = now
        st.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and st.logprobs is not None:
            for d, vals in zip(self._logprob_dicts(out.logprobs), out.logprobs.logprobs):
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
                    stopped_by_string = self._check_stop_strings(st, len(delta))
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
            if self._check_stop_strings(st, len(delta)):
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
    def _check_stop_strings(st: RequestState, new_chars: int) -> bool:
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
