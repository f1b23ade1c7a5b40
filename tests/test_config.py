"""EngineConfig's CPU settings: flags and explicit arguments win over the environment variables
(read in envs.py only), which win over the built-in defaults; bad values are clear errors."""
from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig, cpu_bind_for_rank, parse_cpu_list


def test_cpu_defaults_without_environment(monkeypatch, tmp_path):
    for name in ("PAGEDLLM_DISABLE_CPU_KERNELS", "PAGEDLLM_CPU_KEEP_FREED_MEMORY", "PAGEDLLM_THREADS_PER_RANK",
                 "PAGEDLLM_CPU_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    c = EngineConfig()
    assert c.cpu_kernels and c.cpu_keep_freed_memory
    assert c.cpu_threads is None and c.cpu_threads_bind is None
    assert c.kernel_cache_dir == str(tmp_path / "kernels")


def test_environment_overrides_defaults_and_arguments_override_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setenv("PAGEDLLM_CPU_KEEP_FREED_MEMORY", "0")
    monkeypatch.setenv("PAGEDLLM_THREADS_PER_RANK", "3")
    c = EngineConfig()
    assert (c.cpu_kernels, c.cpu_keep_freed_memory, c.cpu_threads) == (False, False, 3)
    c = EngineConfig(cpu_kernels=True, cpu_keep_freed_memory=True, cpu_threads=1)
    assert (c.cpu_kernels, c.cpu_keep_freed_memory, c.cpu_threads) == (True, True, 1)


def test_cli_flags_reach_the_config(monkeypatch):
    from pagedllm.entrypoints.cli import _build_parser, engine_config_from_args

    monkeypatch.setenv("PAGEDLLM_THREADS_PER_RANK", "3")
    args = _build_parser().parse_args(["serve", "--no-cpu-kernels", "--cpu-threads", "2",
                                       "--cpu-threads-bind", "0-1", "--no-cpu-keep-freed-memory"])
    c = engine_config_from_args(args)
    assert (c.cpu_kernels, c.cpu_threads, c.cpu_threads_bind, c.cpu_keep_freed_memory) == (False, 2, "0-1", False)
    assert c.engine_core_process is None  # each entry point's default: the server's own process, LLM's one
    c = engine_config_from_args(_build_parser().parse_args(["serve", "--no-engine-core-process"]))
    assert c.engine_core_process is False
    monkeypatch.setenv("PAGEDLLM_ENGINE_CORE_PROCESS", "0")
    assert EngineConfig().engine_core_process is False


def test_bad_thread_settings_name_the_field(monkeypatch):
    with pytest.raises(ValueError, match="cpu_threads must be"):
        EngineConfig(cpu_threads=0)
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        EngineConfig(cpu_threads_bind="0-x")
    with pytest.raises(ValueError, match="2 tensor-parallel ranks"):
        EngineConfig(cpu_threads_bind="0-1", tensor_parallel_size=2)
    monkeypatch.setenv("PAGEDLLM_THREADS_PER_RANK", "many")
    with pytest.raises(ValueError, match="PAGEDLLM_THREADS_PER_RANK"):
        EngineConfig()


def test_cpu_lists_and_binding_per_rank():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_bind_for_rank(None, 0, 1) is None and cpu_bind_for_rank("nobind", 1, 2) is None
    assert cpu_bind_for_rank("0-1|2,3", 1, 2) == [2, 3]
    assert cpu_bind_for_rank("auto", 1, 2, available=[0, 1, 2, 3, 4]) == [2, 3]
    with pytest.raises(ValueError, match="cannot be split"):
        cpu_bind_for_rank("auto", 0, 4, available=[0, 1])


def test_worker_threads_follow_the_binding(monkeypatch):
    torch = pytest.importorskip("torch")
    import os

    from pagedllm.worker.cpu_threads import configure_cpu_threads

    allowed = sorted(os.sched_getaffinity(0))
    prev = torch.get_num_threads()
    try:
        d = configure_cpu_threads(EngineConfig(cpu_threads_bind=str(allowed[0])), 0, 1)
        assert d.threads == 1 and torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {allowed[0]}
        assert d.bind == (allowed[0],)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(prev)


def test_serve_default_batch_follows_the_device(monkeypatch):
    """The CPU server's smaller running batch applies where the engine runs on CPU: device "cpu", or
    "auto" on a host without a GPU (found without importing torch, or by torch once it is imported)."""
    import sys
    import types

    import pagedllm.config as config

    assert config.serve_default_max_num_seqs("cpu") == config.CPU_SERVE_MAX_NUM_SEQS
    assert config.serve_default_max_num_seqs("cuda") == EngineConfig.__dataclass_fields__["max_num_seqs"].default
    for has_gpu in (False, True):
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: has_gpu))
        monkeypatch.setitem(sys.modules, "torch", fake)
        want = 256 if has_gpu else config.CPU_SERVE_MAX_NUM_SEQS
        assert config.serve_default_max_num_seqs("auto") == config.serve_default_max_num_seqs(None) == want
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible to this process
    assert config.serve_default_max_num_seqs("auto") == config.CPU_SERVE_MAX_NUM_SEQS


def test_kv_cache_memory_takes_a_size_with_a_unit():
    """Regression: LLM(kv_cache_memory="64MiB") raised TypeError although the flag accepts it."""
    assert EngineConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20
    assert EngineConfig(kv_cache_memory="1.5GB").kv_cache_memory == 1_500_000_000
    assert EngineConfig(kv_cache_memory=4096).kv_cache_memory == 4096
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="lots")


def test_one_requests_share_of_the_slots():
    """Offline a request may take every slot (one client); serve's default leaves 3/4 to others."""
    import pagedllm.config as config

    assert config.resolve_max_num_seqs_per_request(EngineConfig(max_num_seqs=64)) == 64
    assert config.resolve_max_num_seqs_per_request(EngineConfig(max_num_seqs=64, max_num_seqs_per_request=999)) == 64
    assert config.serve_default_max_num_seqs_per_request(128) == 32 and config.serve_default_max_num_seqs_per_request(2) == 1
    with pytest.raises(ValueError, match="max_num_seqs_per_request"):
        EngineConfig(max_num_seqs_per_request=0)
