"""When speculating loses, stop: a per-step choice between speculative and plain decoding from
measured costs (the cost model of benchmarks/spec_decode.py, kept up to date online).

A decode step of a request yields 1 token plainly and E tokens speculatively (1 + the accepted
drafts, measured). A step costs t_plain or t_spec (wall time between consecutive steps, which
includes the draft model's forwards, the wider verification forward and the engine's overhead).
Speculation pays while E / t_spec >= 1 / t_plain. Both sides are exponential moving averages
over decode-only steps (a step with prefill chunks says little about either, and a gap over
8x the average is the engine idling between requests, not a step); the mode in
favour runs ``window`` steps, then the other one runs ``probe`` steps so its figure stays
current (at most probe / (window + probe) of the steps run in the worse mode). The first
phase is 2 x probe steps, so a short run is not spent in the worse mode. Outputs do not
depend on the choice: plain and speculative steps sample the same distribution.
"""
from __future__ import annotations

import time
from typing import Optional


class SpecGovernor:
    def __init__(self, window: int = 32, probe: int = 4, decay: float = 0.8) -> None:
        self.window, self.probe, self.decay = window, probe, decay
        self.t_spec: Optional[float] = None
        self.t_plain: Optional[float] = None
        self.tokens_spec: Optional[float] = None  # E: tokens per request per speculative step
        self.speculate = True  # the current mode
        self._left = 2 * probe  # steps left in the current phase (the first is short: decide early)
        self._probing = False
        self._last: Optional[tuple[float, bool, bool]] = None  # (start, speculated, decode_only)
        self._pending_tokens: Optional[float] = None
        self.num_plain_steps = 0  # decode steps run plainly (for statistics and tests)

    def _ema(self, old: Optional[float], new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record_tokens(self, tokens_per_row: float) -> None:
        """The speculative step just verified emitted this many tokens per drafted request."""
        self._pending_tokens = tokens_per_row

    @property
    def speculation_pays(self) -> bool:
        if self.t_spec is None or self.t_plain is None or self.tokens_spec is None:
            return True
        return self.tokens_spec / self.t_spec >= 1.0 / self.t_plain

    def begin_step(self, decode_only: bool, now: Optional[float] = None) -> bool:
        """Called at the start of every step with draft slots: speculate in it?"""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            start, spec, was_decode = self._last
            dt = now - start
            ref = self.t_spec if spec else self.t_plain
            if was_decode and (ref is None or dt < 8 * ref):  # a much longer gap: the engine was idle
                if spec and self._pending_tokens is not None:
                    self.t_spec = self._ema(self.t_spec, dt)
                    self.tokens_spec = self._ema(self.tokens_spec, self._pending_tokens)
                elif not spec:
                    self.t_plain = self._ema(self.t_plain, dt)
        self._pending_tokens = None
        self._left -= 1
        if self._left <= 0:
            if self._probing:  # probe over: the better mode runs the next window
                self._probing = False
                self.speculate = self.speculation_pays
                self._left = self.window
            else:  # window over: probe the other mode
                self._probing = True
                self.speculate = not self.speculate
                self._left = self.probe
        self._last = (now, self.speculate, decode_only)
        if not self.speculate:
            self.num_plain_steps += 1
        return self.speculate
