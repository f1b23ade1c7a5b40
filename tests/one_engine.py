"""One multi-process (tensor/pipeline parallel) engine per test module, reused by consecutive tests
that ask for the same settings: each new engine costs a spawned interpreter, a torch import and a
model load per rank, a reused one nothing. A process holds one process group, so asking for other
settings shuts the current engine down first; one left dead (a killed rank) is replaced. A module
keeps one at module level (its helpers build engines) and closes it in a module fixture's teardown.
Close it before building a single-process engine too: that one's executor resets this process's
tensor/pipeline groups (executor/uniproc.py), which a live pipeline-parallel engine's stage 0 reads
at every step (its next step fails: "Pair is not connected")."""
from __future__ import annotations


class OneEngine:
    def __init__(self, **defaults) -> None:
        self.defaults = defaults
        self.llm, self.kw = None, None

    def get(self, **kw):
        """The LLM(**defaults, **kw): the current one when the settings match and its ranks live."""
        from pagedllm import LLM

        kw = {**self.defaults, **kw}
        if self.llm is not None and (kw != self.kw or not all(p.is_alive() for p in self.llm.engine.core.executor.procs)):
            self.close()
        if self.llm is None:
            self.llm, self.kw = LLM(**kw), kw
        return self.llm

    def close(self) -> None:
        """Shut the current engine down (before a test builds a multi-process engine of its own)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.engine.shutdown()

