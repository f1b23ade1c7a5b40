"""What one output constraint may cost (issue 29): its size, nesting and alternatives are checked
before anything is compiled, and a compile gets a bounded share of a pool of its own.

A grammar compile cannot be interrupted once xgrammar runs it (it is C++ on a worker thread), so
its cost is bounded up front by the constraint's shape: bytes of its text, nesting depth of a
JSON schema, alternatives in one ``enum`` / ``anyOf`` / ``oneOf`` / ``choice`` list. Each limit
is a field of EngineConfig (``structured_*``), and exceeding one is a ValueError naming the
request field and the limit (HTTP 400).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams


class CompileTimeoutError(TimeoutError):
    """A constraint did not compile within ``structured_compile_timeout`` (HTTP 408)."""


def compile_timeout(spec: StructuredOutputsParams, seconds: float) -> CompileTimeoutError:
    return CompileTimeoutError(f"structured_outputs.{spec.kind} did not compile within the limit of {seconds:g} s "
                               "(structured_compile_timeout)")


class CompilePoolFullError(RuntimeError):
    """Every compile worker is busy and the compile queue is full (HTTP 429, retry later)."""


@dataclass(frozen=True)
class CompileLimits:
    max_bytes: int = 64 << 10  # the constraint's text (a JSON schema as JSON, a regex, a grammar, all choices)
    max_depth: int = 64  # nesting of a JSON schema's objects and arrays
    max_alternatives: int = 1024  # entries of one enum / anyOf / oneOf list, or choices
    workers: int = 2  # compile threads (their own: never the tokenizer's)
    max_queued: int = 16  # compiles waiting for a worker, beyond those running
    timeout: float = 10.0  # seconds a request waits for its compile
    cache_bytes: int = 256 << 20  # compiled grammars kept (their memory_size_bytes)

    @classmethod
    def from_config(cls, config) -> "CompileLimits":
        return cls(config.structured_max_bytes, config.structured_max_depth, config.structured_max_alternatives,
                   config.structured_compile_workers, config.structured_max_queued_compiles,
                   config.structured_compile_timeout, config.structured_cache_bytes)

    def check(self, spec: StructuredOutputsParams, key: tuple[str, str]) -> None:
        """ValueError naming the field and the limit when ``spec`` (whose cache key, with its
        canonical text, is ``key``) is over one."""
        kind, text = key
        field = f"structured_outputs.{kind}"
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise ValueError(f"{field} is {size} bytes, over the limit of {self.max_bytes} bytes "
                             "(structured_max_bytes)")
        if kind == "choice" and len(spec.choice) > self.max_alternatives:
            raise ValueError(f"{field} has {len(spec.choice)} choices, over the limit of {self.max_alternatives} "
                             "(structured_max_alternatives)")
        if kind in ("json", "structural_tag"):
            self._check_schema(json.loads(text), field)

    def _check_schema(self, schema: Any, field: str) -> None:
        """Walks the schema without recursion (a deep one cannot overflow the stack here)."""
        stack = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > self.max_depth:
                raise ValueError(f"{field} nests deeper than the limit of {self.max_depth} levels "
                                 "(structured_max_depth)")
            if isinstance(node, dict):
                for name in ("enum", "anyOf", "oneOf"):
                    alts = node.get(name)
                    if isinstance(alts, list) and len(alts) > self.max_alternatives:
                        raise ValueError(f"{field}: an {name} has {len(alts)} entries, over the limit of "
                                         f"{self.max_alternatives} (structured_max_alternatives)")
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
