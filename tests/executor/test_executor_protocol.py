"""Every executor satisfies the Executor Protocol: every member it names, with the same kind
(method / readable attribute) and the same method signatures. Checked statically with inspect
(no TP ranks spawned), and on a live UniprocExecutor with isinstance."""
import inspect

import pytest

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor
from pagedllm.executor.simulated import SimulatedDeviceExecutor
from pagedllm.executor.uniproc import UniprocExecutor

MEMBERS = {"num_blocks", "max_model_len", "sliding_window", "num_forward_tokens", "weight_bytes_per_rank", "is_dead", "execute", "shutdown",
           "kv_tier_spec", "dead_reason", "max_concurrent_batches", "idle_work",
           "submit", "collect"}


def protocol_members():
    return {n for n in vars(Executor) if not n.startswith("_")} | set(Executor.__annotations__)


def test_protocol_names_what_the_engine_needs():
    assert protocol_members() == MEMBERS


@pytest.mark.parametrize("cls", [UniprocExecutor, MultiprocExecutor, RayExecutor, SimulatedDeviceExecutor])
def test_executor_class_satisfies_protocol(cls):
    for name in sorted(protocol_members()):
        want = inspect.getattr_static(Executor, name, None)
        if inspect.isfunction(want):  # a method: same parameters, names and kinds
            have = inspect.getattr_static(cls, name, None)
            assert inspect.isfunction(have), f"{cls.__name__}.{name} is not a method"
            ps_want = [(p.name, p.kind) for p in inspect.signature(want).parameters.values()]
            ps_have = [(p.name, p.kind) for p in inspect.signature(have).parameters.values()]
            assert ps_have == ps_want, f"{cls.__name__}.{name}{inspect.signature(have)} != {inspect.signature(want)}"
        else:  # readable data: a property, a class attribute or a declared instance attribute
            declared = name in getattr(cls, "__annotations__", {})
            have = inspect.getattr_static(cls, name, None)
            assert declared or have is not None, f"{cls.__name__} lacks {name}"
            assert not inspect.isfunction(have), f"{cls.__name__}.{name} is a method, the Protocol reads it"


def test_live_uniproc_executor_is_an_executor(make_ckpt):
    path = make_ckpt("exec_llama", "llama")
    config = EngineConfig(model=path, dtype="float32", kv_cache_memory=1 << 20)
    from pagedllm.engine.core import EngineCore

    core = EngineCore(config)
    try:
        ex = core.executor
        assert isinstance(ex, UniprocExecutor) and isinstance(ex, Executor)
        assert ex.num_blocks > 0 and ex.weight_bytes_per_rank[0] > 0 and not ex.is_dead
        assert ex.num_forward_tokens == 0
    finally:
        core.shutdown()
