"""Memory planned, not refused: the CPU KV cache is sized from the memory available to the
process (cgroup v2/v1 limits, MemAvailable), and a max_model_len the cache cannot hold is lowered
to what fits when the user did not set it (else a clear error naming the largest value)."""
import logging
import os

import pytest

from pagedllm.config import fit_max_model_len
from pagedllm.worker.memory_plan import HostMemory, cpu_kv_budget, read_host_memory

GiB, MiB = 1 << 30, 1 << 20


def fake_root(tmp_path, meminfo_kb=None, cgroup_line=None, files=None):
    """A fake / with proc/meminfo, proc/self/cgroup and sys/fs/cgroup/... files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    if meminfo_kb is not None:
        (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    if cgroup_line is not None:
        (tmp_path / "proc/self/cgroup").write_text(cgroup_line + "\n")
    for rel, text in (files or {}).items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


def test_meminfo_only(tmp_path):
    host = read_host_memory(fake_root(tmp_path, meminfo_kb=8 << 20))
    assert host.available == 8 * GiB and host.cgroup_limit is None


def test_cgroup_v2_limit_is_respected(tmp_path):
    root = fake_root(tmp_path, meminfo_kb=64 << 20, cgroup_line="0::/", files={
        "sys/fs/cgroup/memory.max": str(4 * GiB),
        "sys/fs/cgroup/memory.current": str(3 * GiB),
        "sys/fs/cgroup/memory.stat": f"anon 1\ninactive_file {1 * GiB}\n",  # reclaimable: not counted as used
    })
    host = read_host_memory(root)
    assert host.cgroup_limit == 4 * GiB and host.available == 2 * GiB


def test_cgroup_v2_unlimited_and_nested(tmp_path):
    root = fake_root(tmp_path, meminfo_kb=16 << 20, cgroup_line="0::/a/b", files={
        "sys/fs/cgroup/memory.max": "max",
        "sys/fs/cgroup/a/memory.max": str(1 * GiB),  # an ancestor's limit applies too
        "sys/fs/cgroup/a/memory.current": str(256 * MiB),
        "sys/fs/cgroup/a/b/memory.max": "max",
        "sys/fs/cgroup/a/b/memory.current": str(100 * MiB),
    })
    assert read_host_memory(root).available == 768 * MiB
    open(os.path.join(root, "sys/fs/cgroup/a/memory.max"), "w").write("max")
    assert read_host_memory(root).available == 16 * GiB


def test_cgroup_v1_limit(tmp_path):
    root = fake_root(tmp_path, meminfo_kb=16 << 20, cgroup_line="4:memory:/docker/x", files={
        "sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes": str(2 * GiB),
        "sys/fs/cgroup/memory/docker/x/memory.usage_in_bytes": str(512 * MiB),
        "sys/fs/cgroup/memory/docker/x/memory.stat": "total_inactive_file 0\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
    })
    assert read_host_memory(root).available == 1536 * MiB


def test_this_machine_reads_something():
    assert read_host_memory().available > 0


def test_budget_shares_between_ranks_with_headroom():
    host = HostMemory(mem_available=8 * GiB)
    assert cpu_kv_budget(host, 0.5, 1, 0) == 4 * GiB
    assert cpu_kv_budget(host, 0.5, 2, 256 * MiB) == 2 * GiB - 256 * MiB
    assert cpu_kv_budget(HostMemory(mem_available=100 * MiB), 0.5, 1, 1 * GiB) == 0


def test_fit_max_model_len():
    assert fit_max_model_len(100, 16, 1024, user_set=True) == 1024
    assert fit_max_model_len(10, 16, 131072, user_set=False) == 160
    with pytest.raises(ValueError, match=r"largest max_model_len that fits is 160"):
        fit_max_model_len(10, 16, 131072, user_set=True)
    with pytest.raises(ValueError, match="not even one sequence"):
        fit_max_model_len(0, 16, 1024, user_set=False)


@pytest.fixture(scope="module")
def long_ckpt(make_ckpt):
    return make_ckpt("long_context", "llama", max_pos=131072)


def test_long_context_model_starts_with_lowered_max_model_len(long_ckpt, caplog):
    from pagedllm import LLM, SamplingParams

    with caplog.at_level(logging.INFO):
        llm = LLM(model=long_ckpt, dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=4)
    core = llm.engine.core
    fits = core.num_blocks * 16
    assert fits < 131072
    # Everyone sees the lowered value: engine, scheduler, input checks (and so the server).
    assert core.max_model_len == llm.engine.max_model_len == core.scheduler.limits.max_model_len == fits
    assert llm.engine.input_processor.max_model_len == fits
    assert any("max_model_len lowered from 131072" in r.message for r in caplog.records)
    plan = [r.message for r in caplog.records if r.message.startswith("memory plan")]
    assert plan and f"= {fits} tokens" in plan[0] and "max concurrency" in plan[0]
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * fits], use_tqdm=False)


def test_explicit_max_model_len_that_does_not_fit_names_the_largest(long_ckpt):
    from pagedllm import LLM

    with pytest.raises(ValueError, match=r"max_model_len 131072 does not fit .* largest max_model_len that fits is \d+"):
        LLM(model=long_ckpt, dtype="float32", kv_cache_memory=1 << 20, max_model_len=131072)


def test_cpu_cache_sized_from_available_memory(long_ckpt, monkeypatch):
    """No kv_cache_memory: cpu_memory_utilization x what the host (faked: 256 MiB) has left."""
    from pagedllm import LLM
    from pagedllm.worker import worker as worker_mod

    monkeypatch.setattr(worker_mod, "read_host_memory", lambda: HostMemory(mem_available=256 * MiB))
    llm = LLM(model=long_ckpt, dtype="float32", cpu_memory_utilization=0.25, max_num_seqs=64, max_model_len=4096)
    w = llm.engine.core.executor.worker
    budget = cpu_kv_budget(HostMemory(mem_available=256 * MiB), 0.25, 1, w.activation_bytes)
    assert 0 < budget < 64 * MiB and w.activation_bytes > 0
    assert llm.engine.core.num_blocks == budget // w.kv_spec.bytes_per_block
    assert "cpu_memory_utilization 0.25" in w.budget_note


def test_kv_cache_memory_overrides_and_too_little_memory_is_clear(long_ckpt, monkeypatch):
    from pagedllm import LLM
    from pagedllm.worker import worker as worker_mod

    monkeypatch.setattr(worker_mod, "read_host_memory", lambda: HostMemory(mem_available=1 * MiB))
    with pytest.raises(ValueError, match=r"not even one sequence fits.*1.0 MiB available"):
        LLM(model=long_ckpt, dtype="float32", max_num_seqs=4)
    llm = LLM(model=long_ckpt, dtype="float32", kv_cache_memory=2 << 20, max_num_seqs=4)  # the host is not asked
    assert llm.engine.core.num_blocks == (2 << 20) // llm.engine.core.executor.worker.kv_spec.bytes_per_block


class _CudaStub:
    """torch.cuda's memory queries for a GPU budget without a GPU: 80 GiB card, 70 GiB free."""

    def __init__(self, monkeypatch, peak):
        import torch

        import pagedllm.worker.profile as profile

        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * GiB, 80 * GiB))
        monkeypatch.setattr(profile, "profile_peak_forward", lambda worker, n: peak)


def _gpu_worker(**config):
    from types import SimpleNamespace

    from pagedllm.worker.worker import Worker

    w = SimpleNamespace(config=SimpleNamespace(gpu_memory_utilization=0.9, **config), max_num_batched_tokens=2048,
                        device="cuda:0", budget_note="")
    return lambda: Worker.kv_budget_on_cuda(w), w


def test_kv_cache_memory_applies_on_cuda(monkeypatch):
    """On a GPU an explicit kv_cache_memory replaces gpu_memory_utilization (as on CPU); without it
    the budget is utilization x total - in use - activations."""
    _CudaStub(monkeypatch, peak=2 * GiB)
    budget, w = _gpu_worker(kv_cache_memory=3 * GiB)
    assert budget() == 3 * GiB and "set explicitly" in w.budget_note and w.activation_bytes == 2 * GiB
    budget, _ = _gpu_worker(kv_cache_memory=None)
    assert budget() == int(0.9 * 80 * GiB - 10 * GiB - 2 * GiB)


def test_kv_cache_memory_too_large_for_the_gpu_names_the_field(monkeypatch):
    _CudaStub(monkeypatch, peak=2 * GiB)
    budget, _ = _gpu_worker(kv_cache_memory=69 * GiB)  # 70 free - 2 activations = 68
    with pytest.raises(ValueError, match="kv_cache_memory"):
        budget()
