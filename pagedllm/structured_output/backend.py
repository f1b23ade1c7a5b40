"""The grammar backend: xgrammar, over our tokenizer, with a compile cache.

``GrammarBackend`` turns a StructuredOutputsParams into an xgrammar CompiledGrammar, keyed by
the constraint's text (``spec_key``) so one schema sent by a thousand requests is compiled
once; the cache is bounded in bytes (each grammar's ``memory_size_bytes``), not only entries. The tokenizer info (each token's bytes, the vocabulary type, the stop tokens) is built
once, for the model's logits width: ids the tokenizer does not know (a vocabulary padded to a
multiple of 64, say) are never allowed by a mask.

JSON grammars allow no free whitespace (``any_whitespace=False``, json.dumps' separators), so a
schema whose strings and arrays are bounded is always finished within a computable number of
tokens. Compile errors become ValueErrors naming the field (``structured_outputs.json`` ...).

Where a compile runs: on the caller's thread, or (``CompileIsolation``, the engine's default) in
a compile worker process that is killed when the compile runs too long or nobody waits for it
(structured_output/compile_process.py); the compiled grammar comes back serialized and is
cached here, in the one process that compiles (the engine core).

xgrammar is an optional dependency (the ``structured`` extra): it is imported on first use, and
its absence is a clear error naming the extra, never an import failure at start-up.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammars import compile_with


@dataclass(frozen=True)
class CompileIsolation:
    """Compiles in worker processes (structured_output/compile_process.py): ``memory_limit``
    bytes a worker's heap may grow by, ``recycle_bytes`` of resident growth after which a worker
    is retired. What is bounded up front stays on the caller's thread (cheaper than the round
    trip): ``json_object`` (one fixed grammar) and choice lists of at most ``inline_choice_bytes``
    (literals: their cost grows with their bytes). A regex, grammar or schema has no such bound
    (``[a-z]{1000}`` is short), so it always goes to a worker. ``worker_module``: what a worker
    runs (``python -m``; a test's module may wrap the compile)."""

    memory_limit: int = 1 << 30
    recycle_bytes: int = 128 << 20
    inline_choice_bytes: int = 4096
    idle_s: float = 30.0  # a worker idle this long is stopped (started again by the next compile)
    worker_module: str = "pagedllm.structured_output.compile_process"  # run as ``python -m``

    @classmethod
    def from_config(cls, config) -> Optional["CompileIsolation"]:
        """EngineConfig's choice (None: compiles on threads)."""
        if config.structured_compile_isolation != "process":
            return None
        return cls(memory_limit=config.structured_compile_memory)

    def inline(self, key: tuple[str, str]) -> bool:
        kind, text = key
        return kind == "json_object" or (kind == "choice" and len(text) <= self.inline_choice_bytes)


_CACHE_ENTRIES = 512
_THREADED_WORK = 16 * 128_000  # rows x vocabulary above which the bitmask fill uses two threads


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs (and tool calling with tool_choice 'required' or a named function) need "
                         "xgrammar: install pagedllm with the 'structured' extra (pip install 'pagedllm[structured]')"
                         ) from e
    return xgrammar


def _json_value(value, kind: str):
    """A constraint given as an object or as its JSON text: the object."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"structured_outputs.{kind} nests too deeply") from None


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """The compile cache key: the constraint's kind and its text. A JSON schema's keys keep their
    order (never sorted): the grammar writes an object's properties in the schema's order, so a
    schema that puts ``reasoning`` before ``answer`` gets them in that order."""
    kind = spec.kind
    if kind == "json":
        value = _json_value(spec.json, kind)
        if not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return kind, json.dumps(value, ensure_ascii=False)
    if kind == "structural_tag":
        value = _json_value(spec.structural_tag, kind)
        if not isinstance(value, dict):
            raise ValueError("structured_outputs.structural_tag must be an object")
        return kind, json.dumps(value, ensure_ascii=False)
    if kind == "choice":
        return kind, json.dumps(spec.choice, ensure_ascii=False)
    if kind == "json_object":
        return kind, ""
    return kind, spec.regex if kind == "regex" else spec.grammar


def _size_of(compiled) -> int:
    """A compiled grammar's memory (xgrammar's own count: its token-mask cache and grammar),
    which tracks the process's RSS growth per compile within a factor of ~2 (docs/benchmarks.md)."""
    return int(compiled.memory_size_bytes)


class GrammarBackend:
    """Compiles constraints for one tokenizer and logits width (thread-safe; cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_bytes: int = 256 << 20,
                 isolation: Optional[CompileIsolation] = None) -> None:
        self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.tokenizer_info = self._tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.compiler = self.xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self.isolation = isolation  # None: every compile on the caller's thread
        self._pool = None  # compile_process.WorkerPool, on the first compile in a worker
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.cache_bytes = cache_bytes  # the compiled grammars' memory_size_bytes kept at most
        self.cache_size_bytes = 0
        self._lock = threading.Lock()
        self.num_compiles = 0
        self._batch = None

    def _tokenizer_info(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        from pagedllm.tokenizer.light_tokenizer import LightTokenizer

        xgr = self.xgr
        if isinstance(tokenizer, LightTokenizer):  # xgrammar reads a transformers tokenizer: its Rust one, wrapped
            from transformers import PreTrainedTokenizerFast  # xgrammar imports transformers already

            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
        stops = list(stop_token_ids) or None
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)

    def compile(self, spec: StructuredOutputsParams):
        """The CompiledGrammar of ``spec`` (from the cache when seen before); ValueError naming
        the field when the constraint does not compile."""
        key = spec_key(spec)
        return self.cached(key) or self.compile_key(key)

    def cached(self, key: tuple[str, str]):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile_key(self, key: tuple[str, str], timeout: Optional[float] = None,
                    abandoned: Optional[Callable[[], bool]] = None):
        """Compile (on the caller's thread, or in a compile worker process: ``isolation``) and
        keep the result while the cache's bytes allow: least recently used grammars go first;
        one larger than the whole budget is not kept. In a worker, the compile is stopped after
        ``timeout`` seconds (CompileDeadlineError) or once ``abandoned()`` (CompileStopped)."""
        if self.isolation is not None and not self.isolation.inline(key):
            compiled = self._compile_in_worker(key, timeout, abandoned)
        else:
            compiled = self._compile(key)
        if not self._allows_a_first_token(compiled):  # e.g. root ::= root: sampling would have no token at all
            raise ValueError(f"structured_outputs.{key[0]}: the constraint allows no output at all (not even the "
                             "end of text): no rule reaches a terminal")
        size = _size_of(compiled)
        with self._lock:
            self.num_compiles += 1
            if key not in self._cache and size <= self.cache_bytes:
                self._cache[key] = compiled
                self._sizes[key] = size
                self.cache_size_bytes += size
                while len(self._cache) > _CACHE_ENTRIES or self.cache_size_bytes > self.cache_bytes:
                    old, _ = self._cache.popitem(last=False)
                    self.cache_size_bytes -= self._sizes.pop(old)
        return compiled

    def _compile(self, key: tuple[str, str]):
        return compile_with(self.compiler, key)

    def _compile_in_worker(self, key, timeout, abandoned):
        from pagedllm.structured_output.compile_process import worker_pool

        if self._pool is None:
            iso = self.isolation
            self._pool = worker_pool(self.tokenizer_info.serialize_json(), iso.memory_limit, iso.recycle_bytes,
                                     iso.worker_module, iso.idle_s)
        text = self._pool.compile(key, timeout if timeout is not None else 3600.0, abandoned or (lambda: False))
        return self.xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)

    def shutdown(self) -> None:
        """Stop the idle compile workers (shared by this process's backends: a later compile
        starts them again)."""
        if self._pool is not None:
            self._pool.stop_idle()

    def _allows_a_first_token(self, compiled) -> bool:
        mask = self.allocate_bitmask(1)
        self.matcher(compiled).fill_next_token_bitmask(mask)
        return bool(mask.ne(0).any())

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def batch_fill(self, matchers: list, bitmask, indices: Optional[list[int]] = None) -> None:
        """One call fills every constrained row's allowed-token bits. Small batches on one thread:
        handing 64 rows of a 2k vocabulary to two threads cost 0.35 ms against 0.02 ms on one
        (and far more on a loaded machine); large batches of large vocabularies gain from two."""
        if self._batch is None:
            self._batch = (self.xgr.BatchGrammarMatcher(max_threads=1), self.xgr.BatchGrammarMatcher(max_threads=2))
        many = len(matchers) * self.vocab_size >= _THREADED_WORK
        self._batch[many].batch_fill_next_token_bitmask(matchers, bitmask, indices)
