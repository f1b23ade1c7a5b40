"""The C heap's free memory handed back to the system (glibc's ``malloc_trim``).

glibc keeps memory that was freed -- a large request body, a compiled grammar dropped from the
cache, a burst of threads' arenas -- in the process (its resident size stays at the high-water
mark) until something trims it. ``trim_freed_memory`` does that once; ``IdleTrimmer`` does it
when a process has been idle for a while after work (the server's front end and the engine
core each run one), so a server that served a burst returns toward its resting size. On a C
library without malloc_trim both do nothing.
"""
from __future__ import annotations

import ctypes
import gc
import time
from contextlib import contextmanager
from typing import Iterator

_libc = None


def trim_freed_memory() -> bool:
    """Trim the heap now; False where this C library cannot."""
    global _libc
    if _libc is False:
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):  # not glibc
        _libc = False
        return False


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now (modules, the tokenizer, the engine's Python
    side) into the garbage collector's permanent generation, so later full collections no longer
    walk them. In a long-lived server process only: a full collection over the ~200k objects a
    started server holds paused its event loop 130-180 ms (/health's slowest answers under load);
    what is frozen is never collected, so a process that builds and drops engines must not call it."""
    gc.collect()
    gc.freeze()


@contextmanager
def old_objects_frozen() -> Iterator[None]:
    """For a run loop in a process that may build and drop engines (the offline ``LLM``): while
    it runs, every object older than the loop sits in the permanent generation, so the full
    collections the loop's allocations trigger walk only what the loop made (a full collection
    over a loaded engine's ~180k objects took ~75 ms, ~0.6 ms a step over a 128-step run of 256
    requests); afterwards they are collectable again, as before. Does nothing where objects are
    frozen already (a server's start-up, or the caller's own ``gc.freeze``: unfreezing would
    undo theirs) or the collector is off."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def collect_and_trim() -> bool:
    """For an idle process: collect cyclic garbage first (an exception's traceback that still holds
    a request's parsed body, say: nothing triggers a collection while nothing allocates), then
    trim the heap."""
    gc.collect()
    return trim_freed_memory()


class IdleTrimmer:
    """``busy()`` whenever work is done; ``idle()`` while there is none: the heap is trimmed once
    ``after_s`` seconds into an idle stretch that followed work."""

    def __init__(self, after_s: float = 5.0, clock=time.monotonic) -> None:
        self.after_s = after_s
        self._clock = clock
        self._worked = False
        self._idle_since = None

    def busy(self) -> None:
        self._worked = True
        self._idle_since = None

    def idle(self) -> None:
        if not self._worked:
            return
        now = self._clock()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.after_s:
            collect_and_trim()
            self._worked = False
