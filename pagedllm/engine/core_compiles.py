"""The front end's side of grammar compiles when the engine core runs in its own process.

One process compiles and caches structured-output grammars: the engine core, where the bitmask
is applied (a compiled grammar is not shipped: the core's own compile serves the request that
follows from its cache). The front end checks the limits here (an over-limit constraint is a
400 without a round trip) and asks the core to compile, which answers only whether it compiled
(ValueError naming the field, CompilePoolFullError), so the server can refuse a bad constraint
before a stream starts. Withdrawing the Future (a client gone, the timeout) withdraws the
compile in the core.
"""
from __future__ import annotations

from concurrent.futures import Future

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import spec_key
from pagedllm.structured_output.limits import CompileLimits, CompileTimeoutError, compile_timeout


class CoreCompiles:
    """What InputProcessor uses as its compiler (StructuredOutputManager's submit / validate)."""

    def __init__(self, client, limits: CompileLimits) -> None:
        self.client = client  # a MultiprocClient
        self.limits = limits

    def submit(self, spec: StructuredOutputsParams) -> Future:
        self.limits.check(spec, spec_key(spec))
        return self.client.call_async("compile_structured_outputs", spec)

    def validate(self, spec: StructuredOutputsParams) -> None:
        fut = self.submit(spec)
        try:
            self.client.wait_for(fut, self.limits.timeout, "a grammar compile")
        except CompileTimeoutError:
            raise
        except TimeoutError:
            raise self.timeout_error(spec) from None

    def timeout_error(self, spec: StructuredOutputsParams) -> CompileTimeoutError:
        return compile_timeout(spec, self.limits.timeout)
