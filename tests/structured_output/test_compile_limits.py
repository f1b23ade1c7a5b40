"""Grammar compiles are bounded (issue 29): a constraint over a size / depth / alternatives limit
is refused before anything compiles (ValueError naming the limit); compiles run on a pool of
their own threads with a wall-clock limit, a bounded queue, withdrawal when the caller goes away
(a queued compile nobody waits for is dropped), one compile for all callers of one constraint,
and a compile cache bounded in bytes (xgrammar's memory_size_bytes)."""
import json
import threading
from concurrent.futures import CancelledError

import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sampling_params import StructuredOutputsParams as S  # noqa: E402
from pagedllm.structured_output import backend as backend_mod  # noqa: E402
from pagedllm.structured_output.limits import CompileLimits, CompilePoolFullError, CompileTimeoutError  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from pagedllm.tokenizer.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return load_tokenizer(default_model)


def manager(tokenizer, **limits) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, 1024, [0], CompileLimits(**limits))


def nested_array(depth: int) -> dict:
    return json.loads('{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth)


@pytest.mark.parametrize("spec, limit", [
    (S(choice=["x" * 70_000]), "structured_max_bytes"),
    (S(choice=[f"c{i}" for i in range(1025)]), "structured_max_alternatives"),
    (S(regex="(ab|cd)" * 20_000), "structured_max_bytes"),
    (S(grammar='root ::= "' + "a" * 70_000 + '"'), "structured_max_bytes"),
    (S(json={"enum": list(range(2000))}), "structured_max_alternatives"),
    (S(json={"anyOf": [{"const": i} for i in range(1500)]}), "structured_max_alternatives"),
    (S(json={"type": "object", "properties": {"a": {"oneOf": [{"const": i} for i in range(1025)]}}}),
     "structured_max_alternatives"),
    (S(json=nested_array(70)), "structured_max_depth"),  # 71 levels of JSON objects
    (S(json=json.dumps(nested_array(900))), "structured_max_depth"),  # the issue's 900-deep array, as text
])
def test_over_a_limit_is_refused_before_compiling(tokenizer, monkeypatch, spec, limit):
    m = manager(tokenizer)
    monkeypatch.setattr(backend_mod.GrammarBackend, "_compile", lambda self, key: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=limit) as e:
        m.validate(spec)
    assert str(e.value).startswith(f"structured_outputs.{spec.kind}")


def test_under_the_limits_compiles(tokenizer):
    m = manager(tokenizer)
    m.validate(S(json=nested_array(20)))
    m.validate(S(choice=[f"c{i}" for i in range(1024)]))
    m.validate(S(json={"enum": list(range(1024))}))
    assert m.backend.num_compiles == 3


class SlowCompiles:
    """GrammarBackend._compile that blocks until released, recording its threads."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started: list[str] = []
        self.threads: set[str] = set()
        real = backend_mod.GrammarBackend._compile

        def slow(backend, key):
            self.started.append(key[1])
            self.threads.add(threading.current_thread().name)
            assert self.release.wait(30)
            return real(backend, key)

        monkeypatch.setattr(backend_mod.GrammarBackend, "_compile", slow)


def test_timeout_queue_bound_withdrawal_and_sharing(tokenizer, monkeypatch):
    m = manager(tokenizer, workers=1, max_queued=1, timeout=0.3)
    m.backend  # built before compiles are slowed
    slow = SlowCompiles(monkeypatch)
    a, b, c = S(choice=["a"]), S(choice=["b"]), S(choice=["c"])
    with pytest.raises(CompileTimeoutError, match=r"within the limit of 0.3 s \(structured_compile_timeout\)"):
        m.validate(a)  # a keeps running in the pool (a running compile cannot be interrupted)
    fb1, fb2 = m.submit(b), m.submit(b)  # one compile for both callers, queued behind a
    assert m.num_inflight_compiles == 2
    with pytest.raises(CompilePoolFullError, match="structured_max_queued_compiles"):
        m.submit(c)
    fb1.cancel()
    assert m.num_inflight_compiles == 2  # fb2 still waits for b
    fb2.cancel()
    assert m.num_inflight_compiles == 1  # nobody waits for b: dropped before it started
    fc = m.submit(c)  # room again
    slow.release.set()
    assert fc.result(30) is not None
    assert slow.started == ['["a"]', '["c"]']  # b never compiled
    assert slow.threads == {"pagedllm-grammar_0"}  # the manager's own pool, one worker
    with pytest.raises(CancelledError):
        fb1.result(0)
    m.validate(a)  # a finished after its caller gave up: it is cached
    assert m.backend.num_compiles == 2 and m.num_inflight_compiles == 0
    m.shutdown()


def test_compile_errors_reach_every_caller(tokenizer):
    m = manager(tokenizer)
    bad = S(regex="(unclosed")
    f1, f2 = m.submit(bad), m.submit(bad)
    for f in (f1, f2):
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            f.result(30)


def test_cache_is_bounded_in_bytes(tokenizer):
    probe = manager(tokenizer)
    one = probe.backend.compile(S(choice=["w" * 4000]))
    size = one.memory_size_bytes
    assert size > 0
    m = manager(tokenizer, cache_bytes=int(size * 2.5))
    for i in range(6):
        m.validate(S(choice=[f"{i}" + "w" * 3999]))
        assert m.backend.cache_size_bytes <= m.limits.cache_bytes
    assert len(m.backend._cache) == 2  # the two most recent
    m.validate(S(choice=["5" + "w" * 3999]))
    assert m.backend.num_compiles == 6  # a hit
    tiny = manager(tokenizer, cache_bytes=size // 2)
    tiny.validate(S(choice=["w" * 4000]))
    assert not tiny.backend._cache and tiny.backend.cache_size_bytes == 0  # larger than the whole budget


@pytest.mark.parametrize("spec", [S(grammar="root ::= root"), S(grammar="root ::= a b\na ::= b\nb ::= a"),
                                  S(regex="[^\\s\\S]")])
def test_a_constraint_that_allows_no_output_is_refused(tokenizer, spec):
    with pytest.raises(ValueError, match=f"structured_outputs.{spec.kind}: the constraint allows no output"):
        manager(tokenizer).validate(spec)


def test_an_empty_but_finite_language_is_fine(tokenizer):
    manager(tokenizer).validate(S(grammar='root ::= ""'))  # only the end of text: allowed


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _accepts(backend, spec, text: str) -> bool:
    return backend.matcher(backend.compile(spec)).accept_string(text)


def test_structural_tag_constrains_the_tagged_part(tokenizer):
    """vLLM's structural_tag (structures + triggers: free text, then the schema inside begin...end)
    and xgrammar's newer format (one tag, nothing else)."""
    b = manager(tokenizer).backend
    legacy = S(structural_tag={"structures": [{"begin": "<f>", "schema": OBJ, "end": "</f>"}], "triggers": ["<f>"]})
    assert _accepts(b, legacy, 'ROMEO: <f>{"a": 1}</f> and more')
    assert not _accepts(b, legacy, 'ROMEO: <f>{"b": 1}')
    newer = S(structural_tag=json.dumps({"format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                    "content": {"type": "json_schema", "json_schema": OBJ}}}))
    assert _accepts(b, newer, '<f>{"a": 7}</f>')
    assert not _accepts(b, newer, "ROMEO")
    for bad in ({"structures": [{"begin": "<g>", "schema": OBJ, "end": "</g>"}], "triggers": ["<f>"]},
                {"structures": [], "triggers": ["<f>"]}, {"format": {"type": "nope"}}):
        with pytest.raises(ValueError, match="^structured_outputs.structural_tag"):
            b.compile(S(structural_tag=bad))


def test_a_compile_that_ends_before_submit_returns_does_not_deadlock(tokenizer):
    """A compile can end before submit() registers its callbacks (a fast or cached one); the done
    callback then runs in the submitting thread, which once still held the manager's lock (a
    hang in CI). Forced here with a pool that finishes every compile inside submit."""
    from concurrent.futures import Future

    class DoneAtOnce:
        def submit(self, fn, *args):
            f = Future()
            f.set_result(fn(*args))
            return f

        def shutdown(self, *args, **kw):
            pass

    m = manager(tokenizer)
    m._pool = DoneAtOnce()
    got = []
    t = threading.Thread(target=lambda: got.append(m.submit(S(choice=["yes", "no"])).result(5)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "submit() deadlocked on its own lock"
    assert got and got[0] is not None
    assert m.num_inflight_compiles == 0 and not m._waiters
