"""BeamGroup: the beam-search bookkeeping of one request (pure Python, HF transformers' rules).

The group holds its live beams (core Requests, all the same length, best first) and up to
``width`` finished hypotheses. Each step the runner scores every live beam's next token in one
batched op and returns the group's top ``num_candidates`` continuations across all beams
(cumulative logprob = parent's + token's, best first); ``advance`` then applies HF's
``_beam_search`` step to them:

- a candidate "hits a stop" when its token is a stop token (EOS unless ignore_eos), a stop
  string ends its text, or it reaches max_tokens / max_model_len;
- the best ``width`` candidates that do not hit a stop become the next live beams;
- candidates of rank < width that hit a stop become hypotheses scored
  ``cumulative logprob / (generated tokens ** length_penalty)`` (generated tokens include the
  stop token; compared in log space, ``score_key``, so that no penalty overflows), kept if
  among the best ``width`` hypotheses -- unless every slot is full and
  early_stopping is True, or the early-stop heuristic already said nothing can improve;
- the search ends when the heuristic says no running beam can beat the worst hypothesis
  (early_stopping False: at the current length; "never": at max length when the penalty is
  positive), when early_stopping is True and ``width`` hypotheses exist, or when every candidate
  hit a stop (max length).

Results are the hypotheses, best score first. Blocks and scheduling live in beam_scheduling.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from pagedllm.core.contracts import BeamCandidates, BeamHypothesis, Logprobs
from pagedllm.core.request import Request

EarlyStopping = Union[bool, str]  # True, False or "never"
# (output token ids so far, candidate token) -> the stop string its text now ends with, or None
StopChecker = Callable[[list[int], int], Optional[str]]

_NEG = -1.0e9  # HF's "no hypothesis here" score


def score_key(cum_logprob: float, length: int, length_penalty: float) -> float:
    """Orders scores ``cum_logprob / length ** length_penalty`` exactly (higher key = higher
    score) without computing the power: for cum < 0 the score is ``-exp(log(-cum) - p*log(len))``,
    so the key is ``p*log(len) - log(-cum)``; cum = 0 scores 0, the best (key +inf). Never raises
    for finite penalties and logprobs in [-inf, 0] (a huge penalty only saturates to +-inf)."""
    if cum_logprob >= 0.0:
        return math.inf
    if cum_logprob == -math.inf:
        return -math.inf
    pl = length_penalty * math.log(length) if length > 1 else 0.0
    return pl - math.log(-cum_logprob)


def score_of_key(key: float) -> float:
    """The score a key stands for, as a float (-0.0 / -inf where it underflows / overflows)."""
    if key == math.inf:
        return 0.0
    try:
        return -math.exp(-key)
    except OverflowError:
        return -math.inf


def candidates_per_step(width: int, num_stop_tokens: int) -> int:
    """HF keeps max(2, 1 + #EOS) x width candidates so that ``width`` of them can go on."""
    return max(2, 1 + num_stop_tokens) * width


@dataclass
class _BeamTrace:
    """What a live beam carries besides its Request: its score and per-token logprob rows."""

    cum_logprob: float = 0.0
    logprobs: list[Logprobs] = field(default_factory=list)


class BeamGroup:
    def __init__(self, group_id: str, width: int, length_penalty: float, early_stopping: EarlyStopping,
                 stop_checker: Optional[StopChecker] = None) -> None:
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")
        self.group_id = group_id
        self.width = width
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.stop_checker = stop_checker
        self.beams: list[Request] = []  # live, best first
        self.traces: dict[str, _BeamTrace] = {}
        self.hypotheses: list[BeamHypothesis] = []  # best first, at most width
        self.improvement_possible = True  # HF's is_early_stop_heuristic_unsatisfied (sticky False)
        self.done = False
        self._next_id = 0

    # ---- beams ------------------------------------------------------------------------------
    def start(self, root: Request) -> None:
        self.beams = [root]
        self.traces = {root.request_id: _BeamTrace()}

    def new_beam_id(self) -> str:
        self._next_id += 1
        return f"{self.group_id}#beam{self._next_id}"

    def cum_logprob(self, beam: Request) -> float:
        return self.traces[beam.request_id].cum_logprob

    @property
    def num_candidates(self) -> int:
        return candidates_per_step(self.width, len(self.beams[0].sampling_params.all_stop_token_ids))

    # ---- one step ---------------------------------------------------------------------------
    def advance(self, cands: BeamCandidates, max_model_len: int) -> list[tuple[Request, int, int]]:
        """Apply one step's candidates. Returns the next live beams as (parent, token, candidate
        index), best first; sets ``done`` when the search is over. Hypotheses are recorded here."""
        by_id = {b.request_id: b for b in self.beams}
        parent0 = self.beams[0]
        sp = parent0.sampling_params
        gen_len = parent0.num_output_tokens + 1  # generated tokens once a candidate's token is appended
        at_max = gen_len >= parent0.max_tokens or parent0.num_tokens + 1 >= max_model_len
        full = len(self.hypotheses) >= self.width and self.early_stopping is True
        may_add = self.improvement_possible and not full
        nxt: list[tuple[Request, int, int]] = []
        new_traces: dict[str, _BeamTrace] = {}
        all_hit = True
        for rank, (pid, tok, cum) in enumerate(zip(cands.parent_ids, cands.token_ids, cands.cum_logprobs)):
            parent = by_id[pid]
            stop_str = None
            hit = at_max or tok in sp.all_stop_token_ids
            if not hit and self.stop_checker is not None and (rank < self.width or len(nxt) < self.width):
                stop_str = self.stop_checker(parent.output_token_ids, tok)
                hit = stop_str is not None
            all_hit = all_hit and hit
            if hit:
                if rank < self.width and may_add:
                    self._add_hypothesis(parent, tok, cum, rank, cands, stop_str, at_max)
                continue
            if len(nxt) < self.width:
                nxt.append((parent, tok, rank))
        self._update_heuristic(cands, nxt, gen_len, parent0.max_tokens)
        if all_hit or not nxt or not self.improvement_possible or (
                len(self.hypotheses) >= self.width and self.early_stopping is True):
            self.done = True
        return nxt

    def adopt(self, children: list[Request], nxt: list[tuple[Request, int, int]], cands: BeamCandidates) -> None:
        """The scheduler made ``children`` (one per ``advance`` result): they become the live beams."""
        traces: dict[str, _BeamTrace] = {}
        for child, (parent, _tok, idx) in zip(children, nxt):
            old = self.traces[parent.request_id]
            lps = old.logprobs + [self._logprob_row(cands, idx)] if cands.logprobs is not None else old.logprobs
            traces[child.request_id] = _BeamTrace(cands.cum_logprobs[idx], lps)
        self.beams = children
        self.traces = traces

    @staticmethod
    def _logprob_row(cands: BeamCandidates, idx: int) -> Logprobs:
        lp = cands.logprobs
        assert lp is not None
        return Logprobs([lp.token_ids[idx]], [lp.logprobs[idx]], [lp.sampled_rank[idx]])

    def _add_hypothesis(self, parent: Request, tok: int, cum: float, idx: int, cands: BeamCandidates,
                        stop_str: Optional[str], at_max: bool) -> None:
        key = score_key(cum, parent.num_output_tokens + 1, self.length_penalty)
        if len(self.hypotheses) >= self.width and key <= self._key(self.hypotheses[-1]):
            return
        sp = parent.sampling_params
        if stop_str is not None:
            reason, stop_reason = "stop", stop_str
        elif tok in sp.all_stop_token_ids:
            reason, stop_reason = "stop", (tok if tok in sp.stop_token_ids else None)
        else:
            reason, stop_reason = "length", None
        trace = self.traces[parent.request_id]
        lps = trace.logprobs + [self._logprob_row(cands, idx)] if cands.logprobs is not None else None
        hyp = BeamHypothesis(parent.output_token_ids + [tok], cum, score_of_key(key), lps, reason, stop_reason)
        self.hypotheses.append(hyp)
        self.hypotheses.sort(key=lambda h: -self._key(h))  # stable: an earlier equal score stays first
        del self.hypotheses[self.width:]

    def _update_heuristic(self, cands: BeamCandidates, nxt: list[tuple[Request, int, int]], gen_len: int,
                          max_tokens: int) -> None:
        if not self.improvement_possible or len(self.hypotheses) < self.width:
            return  # HF: an unfinished slot's worst score is -1e9, which any running beam beats
        best_running = cands.cum_logprobs[nxt[0][2]] if nxt else _NEG
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = max_tokens
        else:
            length = gen_len
        self.improvement_possible = (score_key(best_running, length, self.length_penalty)
                                     > self._key(self.hypotheses[-1]))

    def _key(self, h: BeamHypothesis) -> float:
        return score_key(h.cum_logprob, len(h.token_ids), self.length_penalty)

    # ---- results ----------------------------------------------------------------------------
    def results(self) -> list[BeamHypothesis]:
        """The best ``width`` hypotheses, best first; an unfinished search (aborted) adds its live
        beams, scored as if they ended now."""
        out = list(self.hypotheses)
        if len(out) < self.width:
            for b in self.beams:
                t = self.traces.get(b.request_id)
                if t is None or not b.output_token_ids:
                    continue
                score = score_of_key(score_key(t.cum_logprob, b.num_output_tokens, self.length_penalty))
                out.append(BeamHypothesis(list(b.output_token_ids), t.cum_logprob, score,
                                          t.logprobs if t.logprobs else None, "abort", None))
            out.sort(key=lambda h: -self._key(h))
        return out[: self.width]
