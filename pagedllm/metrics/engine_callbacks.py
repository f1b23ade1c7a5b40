"""Several listeners on AsyncLLM's engine-thread callbacks (``on_step(stats, seconds)``,
``on_finished(RequestOutput)``): each new one runs first, then those already installed."""
from __future__ import annotations

from typing import Callable


def chain_engine_callbacks(engine, on_step: Callable, on_finished: Callable) -> None:
    prev_step, prev_finished = engine.on_step, engine.on_finished

    def step(stats, seconds: float) -> None:
        on_step(stats, seconds)
        prev_step(stats, seconds)

    def finished(out) -> None:
        on_finished(out)
        prev_finished(out)

    engine.on_step = step if prev_step is not None else on_step
    engine.on_finished = finished if prev_finished is not None else on_finished
