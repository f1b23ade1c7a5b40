"""When speculating loses, stop: a per-step choice between speculative and plain decoding from
measured costs (the cost model of benchmarks/spec_decode.py, kept up to date online).

The engine core gives it to the scheduler (``Scheduler.spec_governor``), which asks it once per
step, before scheduling, whether decoding requests get draft slots: a plain step reserves none
(no KV slots allocated and rolled back, no draft-model forward, no budget spent on drafts).

A decode step of a request yields 1 token plainly and E tokens speculatively (1 + the accepted
drafts, measured). A step costs t_plain or t_spec: the wall time from one step's scheduling to
the next one's, which includes the draft model's forwards, the wider verification forward and
the engine's own per-step work. Speculation pays while E / t_spec >= margin / t_plain, with a
margin of 5%: near break-even (a draft model about as costly as the tokens it saves) the figures'
noise would flip modes at random, and plain decoding costs nothing extra, so it wins the ties.

Both costs depend on the batch: a forward of 32 requests x (k + 1) tokens is no longer
overhead-bound the way one of 1 x (k + 1) is. So every figure is kept per batch-size bucket
(1, 2-3, 4-7, 8-15, 16-31, 32-63, ...), and each bucket decides on its own: speculation turns
itself off above the batch size where it stops paying (``disabled_buckets``), measured, not
configured.

Per bucket: the first ``probe`` steps speculate, the next ``probe`` decode plainly (both figures
known), then the better mode runs ``window`` steps and the other one is probed for ``probe``
steps so its figure stays current. A probe that confirms the mode in favour doubles that
bucket's window (up to ``max_window``); one that overturns it resets it. Figures are
exponential moving averages over measurable steps only: every scheduled request was decoding
(a prefill chunk says little about either mode), and all of them speculated or none did.

Free plain samples: a speculative step in which no request got a draft (the n-gram lookup found
nothing) cost what a plain step costs; it counts as one, and a plain probe is skipped when
enough of those came in since the last one.

Idle time is not a step: when the engine returns from a step and the next one starts much later
(no requests, or the caller was busy), that interval is dropped.

Outputs never depend on the choice: plain and speculative steps sample the same distribution,
and seeded requests speculate in every step regardless (the scheduler's rule), so their random
streams do not depend on timing.
"""
from __future__ import annotations

import time
from typing import Optional


# Measured on the 2-core AVX-512 CPU (docs/benchmarks.md, issue 20): from 16 running requests on, a
# verification forward of k + 1 tokens per request costs about what its accepted tokens save, and
# at 32 n-gram speculation lost 10-18% on the copy workload (closed batches: requests that finish at
# different steps leave a thin tail). So on CPU, unless the user sets disable_by_batch_size, no
# drafts while this many requests run; below it the governor decides per batch size.
CPU_DISABLE_BATCH_SIZE = 16


def default_disable_batch_size(device: str) -> int:
    """``disable_by_batch_size`` when the user gives none and auto_disable is on: CPU_DISABLE_BATCH_SIZE on CPU, else 0
    (never; the governor still decides per batch-size bucket)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CPU_DISABLE_BATCH_SIZE if device == "cpu" else 0


def scheduler_settings(config) -> tuple[dict, Optional["SpecGovernor"]]:
    """What speculative decoding (``config.speculative_config``) asks of the scheduler: its
    SchedulerLimits fields (draft slots per request, the batch size from which no drafts) and
    the governor that turns drafts off while they lose (None unless auto_disable); ({}, None)
    without speculative decoding."""
    spec = config.speculative_config
    if spec is None:
        return {}, None
    disable = spec.disable_by_batch_size
    if disable is None:  # auto_disable's measured default: 16 on CPU, none elsewhere
        disable = default_disable_batch_size(config.device) if spec.auto_disable else 0
    limits = {"num_spec_tokens": spec.num_speculative_tokens, "spec_disable_batch_size": disable}
    # Wall time, also on CPU: the process's CPU time counts OpenMP threads spinning through a
    # speculative step's longer Python stretches, and the main thread's CPU time misses work on
    # the others; with either, a quiet 2-thread CPU turned a 1.7x n-gram and a 1.2x EAGLE
    # speed-up off (docs/benchmarks.md, issue 20).
    return limits, SpecGovernor() if spec.auto_disable else None


class _Bucket:
    __slots__ = ("t_spec", "t_plain", "tokens_spec", "n_spec", "n_plain", "speculate", "left", "probing",
                 "window", "free_plain", "speculate_before", "unmeasured")

    def __init__(self, window: int) -> None:
        self.t_spec: Optional[float] = None
        self.t_plain: Optional[float] = None
        self.tokens_spec: Optional[float] = None  # E: tokens per decoding request per speculative step
        self.n_spec = 0  # measured steps of each mode
        self.n_plain = 0
        self.speculate = True
        self.left = 0  # steps left in the current phase
        self.probing = True  # the learning steps count as a probe of both modes
        self.window = window
        self.free_plain = 0  # plain samples from draftless speculative steps since the last plain probe
        self.speculate_before: Optional[bool] = None  # the mode in favour when the current probe began
        self.unmeasured = 0  # catch-up steps left out in a row (see SpecGovernor._close)


def bucket_of(batch_size: int) -> int:
    """0 for 1 request, 1 for 2-3, 2 for 4-7, ... (powers of two)."""
    return max(batch_size, 1).bit_length() - 1


class SpecGovernor:
    def __init__(self, window: int = 8, probe: int = 4, decay: float = 0.8, max_window: int = 256,
                 margin: float = 1.05, clock=time.perf_counter) -> None:
        """``clock``: what a step costs: wall time (what a user waits for; tests inject a fake
        clock). CPU-time clocks were tried and mislead on a multi-threaded CPU engine: the
        process's counts OpenMP threads spinning through a speculative step's Python, the main
        thread's misses the other threads' work."""
        self.window, self.probe, self.decay, self.max_window = window, probe, decay, max_window
        self.clock = clock
        self.margin = margin  # speculation must beat plain decoding by this factor: near break-even, plain is safe
        self.buckets: dict[int, _Bucket] = {}
        self.num_plain_steps = 0  # steps planned plain (statistics and tests)
        self.num_spec_steps = 0
        # the step in flight: (start time, bucket, mode "spec"/"plain"/None = not measurable)
        self._step: Optional[tuple[float, int, Optional[str]]] = None
        self._done_at: Optional[float] = None  # when the engine finished the step in flight
        self._tokens: Optional[float] = None  # E of the step in flight (speculative steps)
        self._last_mode: Optional[str] = None  # the mode of the step closed before

    # ---- the decision -----------------------------------------------------------------------
    def _ema(self, old: Optional[float], new: float) -> float:
        """The moving average; a sample over 1.5x it counts as 1.5x (one preempted step must
        not flip the verdict)."""
        return new if old is None else self.decay * old + (1 - self.decay) * min(new, 1.5 * old)

    def _pays(self, b: _Bucket) -> bool:
        if b.t_spec is None or b.t_plain is None or b.tokens_spec is None:
            return True
        return b.tokens_spec / b.t_spec >= self.margin / b.t_plain

    def speculation_pays(self, batch_size: int) -> bool:
        b = self.buckets.get(bucket_of(batch_size))
        return True if b is None else self._pays(b)

    def disabled_buckets(self) -> list[tuple[int, int]]:
        """Batch-size ranges (lo, hi) whose measurements say speculation loses."""
        return [(1 << i, (1 << (i + 1)) - 1) for i, b in sorted(self.buckets.items())
                if b.n_spec and b.n_plain and not self._pays(b)]

    def plan(self, batch_size: int, now: Optional[float] = None) -> bool:
        """Called before scheduling each step that may decode ``batch_size`` requests: do they
        speculate? (Closes the measurement of the step before.)"""
        now = self.clock() if now is None else now
        self._close(now)
        key = bucket_of(batch_size)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self.window)
        if b.n_spec < self.probe:  # learn both costs first: speculative ...
            spec = True
        elif b.n_plain < self.probe:  # ... then plain
            spec = False
        else:
            if b.left <= 0:
                self._next_phase(b)
            b.left -= 1
            spec = b.speculate
        self._step = (now, key, None)
        return spec

    def _next_phase(self, b: _Bucket) -> None:
        pays = self._pays(b)
        if b.probing:  # a probe just ended: the better mode runs the next window, longer if it was confirmed
            b.window = min(2 * b.window, self.max_window) if pays == b.speculate_before else self.window
            b.probing, b.speculate, b.left = False, pays, b.window
            return
        if pays and b.free_plain >= self.probe:  # plain's figure is current without a probe
            b.free_plain, b.speculate, b.left = 0, True, b.window
            return
        if pays:
            b.free_plain = 0
        b.speculate_before = pays
        b.probing, b.speculate, b.left = True, not pays, self.probe

    def scheduled(self, speculated: Optional[bool]) -> None:
        """What the step planned last turned out to be: True / False when every scheduled
        request was decoding and all speculated / none did, None when it is not measurable
        (prefill chunks, a mix, an empty step)."""
        if self._step is not None:
            start, key, _ = self._step
            self._step = (start, key, None if speculated is None else ("spec" if speculated else "plain"))
        if speculated is True:
            self.num_spec_steps += 1
        elif speculated is False:
            self.num_plain_steps += 1

    def verified(self, tokens_per_request: float, num_drafts: int, now: Optional[float] = None) -> None:
        """The step's results: tokens emitted per decoding request, and how many drafts were
        verified in all (0 in a speculative step: it cost what a plain step costs)."""
        self._done_at = self.clock() if now is None else now
        if self._step is None or self._step[2] != "spec":
            return
        if num_drafts == 0:
            self._step = (self._step[0], self._step[1], "free_plain")
        else:
            self._tokens = tokens_per_request

    def _close(self, now: float) -> None:
        step, done, tokens = self._step, self._done_at, self._tokens
        self._step = self._done_at = self._tokens = None
        last, self._last_mode = self._last_mode, (None if step is None else step[2])
        if step is None or step[2] is None or done is None:
            return
        start, key, mode = step
        busy, dt = done - start, now - start
        if now - done > max(2e-3, 2 * busy):  # the engine sat idle after the step: not its cost
            return
        b = self.buckets[key]
        if mode == "spec":
            if tokens is None:
                return
            # The first speculative step after plain or prefill steps is a catch-up: a draft model
            # or EAGLE head first runs over every position it has not seen (the prompt, or the
            # plain stretch), a cost steady speculation never pays. Charged to t_spec, it made each
            # probe look worse than speculation is and kept a 1.2x EAGLE head off. Left out
            # (unless that happened `probe` times in a row: prefill in every other step).
            if last != "spec" and b.unmeasured < self.probe:
                b.unmeasured += 1
                return
            b.unmeasured = 0
            b.t_spec = self._ema(b.t_spec, dt)
            b.tokens_spec = self._ema(b.tokens_spec, tokens)
            b.n_spec += 1
        else:
            b.t_plain = self._ema(b.t_plain, dt)
            b.n_plain += 1
            if mode == "free_plain":
                b.free_plain += 1
