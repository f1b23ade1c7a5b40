"""Chat-template rendering with bounds: a jinja2 sandbox that refuses oversized values, and a
worker process (killed on timeout, memory-capped) for templates a request brought along.

``ImmutableSandboxedEnvironment`` alone bounds neither time nor memory: ``{{ 'ab' * 10**8 }}``
allocates 200 MB, two nested ``range(100000)`` loops run for minutes. Here:

- ``BoundedEnvironment`` intercepts ``*``, ``**`` and ``+`` (a string/list result over
  ``max_output_chars`` or an integer over 4096 bits is refused before it is built), caps
  ``range`` at ``max_output_chars`` items, and ``render_bounded`` stops once the output passes
  ``max_output_chars``;
- ``TemplateSandbox`` renders in small worker processes (spawned, so they share nothing with
  the server; ``RLIMIT_AS`` caps their memory); one that does not answer within the timeout is
  killed and replaced. A template's time, memory and crashes are the worker's, never the
  server's. Compiled templates are kept in a bounded LRU in each process.

The model's own template (trusted as the weights are) renders in-process with the same bounded
environment, off the event loop.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import queue
import threading
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

DEFAULT_MAX_OUTPUT_CHARS = 1 << 20  # 1 Mi characters: far beyond any real prompt's template
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_BYTES = 1 << 30
_MAX_INT_BITS = 4096
_CACHE_SIZE = 32


class TemplateLimitError(ValueError):
    """The template needed more output, memory or time than it is given."""


def _size(x: Any) -> Optional[int]:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _environment(max_output_chars: int):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    n = _size(seq)
                    if n is not None and isinstance(times, int) and n * times > max_output_chars:
                        raise TemplateLimitError(
                            f"the chat template builds a value of {n * times} items (limit {max_output_chars})")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                        and right * abs(left).bit_length() > _MAX_INT_BITS:
                    raise TemplateLimitError(f"the chat template computes an integer over {_MAX_INT_BITS} bits")
            elif operator == "+":
                a, b = _size(left), _size(right)
                if a is not None and b is not None and a + b > max_output_chars:
                    raise TemplateLimitError(
                        f"the chat template builds a value of {a + b} items (limit {max_output_chars})")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def bounded_range(*args):
        r = range(*args)
        if len(r) > max_output_chars:
            raise TemplateLimitError(f"range of {len(r)} items in the chat template (limit {max_output_chars})")
        return r

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = bounded_range
    return env


@lru_cache(maxsize=4)
def _env(max_output_chars: int):
    return _environment(max_output_chars)


@lru_cache(maxsize=_CACHE_SIZE)
def compile_template(template: str, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS):
    """The compiled template (a bounded LRU: distinct templates never grow memory without end)."""
    return _env(max_output_chars).from_string(template)


def render_bounded(template: str, variables: dict[str, Any],
                   max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """Render in this process with the bounded environment; output past the limit is refused."""
    parts, total = [], 0
    for chunk in compile_template(template, max_output_chars).generate(**variables):
        total += len(chunk)
        if total > max_output_chars:
            raise TemplateLimitError(f"the chat template's output passed {max_output_chars} characters")
        parts.append(chunk)
    return "".join(parts)


def load_chat_template(value: str) -> str:
    """``--chat-template``: a template string (it holds ``{``, ``}`` or a newline) or the path of a
    file holding one; compiled now, so a syntax error is a start-up error."""
    if any(c in value for c in "{}\n"):
        template = value
    elif os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {value!r}: {e}") from None
    else:
        raise ValueError(f"chat_template {value!r} looks like a file path, but there is no such file (a template "
                         "string holds {{ ... }} or {% ... %})")
    try:
        compile_template(template)
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        raise ValueError(f"chat_template{' ' + repr(value) if template is not value else ''} is not a valid "
                         f"template: {e}") from None
    return template


# Names chat_template_kwargs may not set: the variables the renderer fills in itself, and the
# parameters of transformers' apply_chat_template (they are not template variables).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize",
    "continue_final_message", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "unk_token", "sep_token",
    "pad_token", "cls_token", "mask_token", "additional_special_tokens",
})


# ---- the worker process ------------------------------------------------------------------------
def _worker_main(conn, max_output_chars: int, memory_bytes: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):  # not Linux, or a lower hard limit: keep what there is
        pass
    while True:
        try:
            template, variables = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", render_bounded(template, variables, max_output_chars)))
        except MemoryError:
            conn.send(("limit", f"the chat template needed more than {memory_bytes >> 20} MiB"))
        except TemplateLimitError as e:
            conn.send(("limit", str(e)))
        except RecursionError:
            conn.send(("limit", "the chat template recursed too deeply"))
        except Exception as e:  # syntax errors, raise_exception(...), undefined names
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, max_output_chars: int, memory_bytes: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, max_output_chars, memory_bytes),
                                name="pagedllm-chat-template", daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class TemplateSandbox:
    """Renders untrusted chat templates in worker processes, each call bounded by ``timeout``
    seconds (a worker that overruns is killed and replaced), ``memory_bytes`` and
    ``max_output_chars``. Thread-safe; ``render`` blocks, so call it off the event loop."""

    def __init__(self, workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        self.timeout, self.max_output_chars, self.memory_bytes = timeout, max_output_chars, memory_bytes
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._closed = False
        for _ in range(workers):
            self._idle.put(None)  # a slot; the process starts on first use

    def _start(self) -> _Worker:
        w = _Worker(self._ctx, self.max_output_chars, self.memory_bytes)
        with self._lock:
            self._all.append(w)
        return w

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def render(self, template: str, variables: dict[str, Any]) -> str:
        if self._closed:
            raise RuntimeError("the template sandbox is closed")
        try:
            w = self._idle.get(timeout=self.timeout)
        except queue.Empty:
            raise TemplateLimitError("every chat-template worker is busy; retry later") from None
        keep: Optional[_Worker] = None
        fresh = w is None or not w.proc.is_alive()
        try:
            if fresh:
                if w is not None:
                    self._drop(w)
                w = self._start()
            w.conn.send((template, variables))
            # The first call also pays the worker's start (spawn + import jinja2).
            if not w.conn.poll(self.timeout + (5.0 if fresh else 0.0)):
                self._drop(w)
                raise TemplateLimitError(f"the chat template did not finish rendering within {self.timeout:g} s")
            try:
                kind, value = w.conn.recv()
            except (EOFError, OSError):  # the worker died (e.g. killed by the OS for memory)
                self._drop(w)
                raise TemplateLimitError("the chat template crashed its rendering process") from None
            keep = w
        finally:
            self._idle.put(keep)
        if kind == "ok":
            return value
        if kind == "limit":
            raise TemplateLimitError(value)
        raise ValueError(value)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for w in workers:
            w.kill()
