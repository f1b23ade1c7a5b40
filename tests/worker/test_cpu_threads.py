"""The CPU thread decision from faked affinity masks and cgroup files (v1 and v2)."""
from __future__ import annotations

import os

import pytest

from pagedllm.worker.cpu_threads import (OMP_WAIT_REASON, CpuFacts, CpuQuota, ThreadGovernor, apply_omp_environment,
                                         choose_omp_environment, decide_cpu_threads, omp_wait_policy, omp_waits_spin,
                                         read_cpu_facts, read_cpu_quota, read_idle_seconds, read_thread_run_wait,
                                         thread_governor)


def _fake_v2(tmp_path, cpu_max: str | None, path: str = "/kubepods/pod1", parent_cpu_max: str | None = None):
    """A cgroup2 hierarchy mounted at tmp/cg2 with this process in ``path``."""
    root = tmp_path / "cg2"
    leaf = root / path.lstrip("/")
    leaf.mkdir(parents=True)
    if cpu_max is not None:
        (leaf / "cpu.max").write_text(cpu_max + "\n")
    if parent_cpu_max is not None:
        (leaf.parent / "cpu.max").write_text(parent_cpu_max + "\n")
    (tmp_path / "cgroup").write_text(f"0::{path}\n")
    (tmp_path / "mountinfo").write_text(
        f"31 23 0:28 / {tmp_path}/tmpfs rw,relatime - tmpfs tmpfs rw,mode=755\n"
        f"41 31 0:38 / {root} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def _fake_v1(tmp_path, quota_us: int | None, period_us: int = 100000, path: str = "/docker/abc",
             mount_root: str = "/", controllers: str = "cpu,cpuacct"):
    """A cgroup v1 cpu,cpuacct hierarchy mounted at tmp/cpu (its root at ``mount_root``)."""
    point = tmp_path / "cpu"
    rel = path[len(mount_root):] if mount_root != "/" else path
    leaf = point / rel.lstrip("/")
    leaf.mkdir(parents=True, exist_ok=True)
    if quota_us is not None:
        (leaf / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
        (leaf / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    (tmp_path / "cgroup").write_text(f"5:memory:/other\n4:{controllers}:{path}\n0::/\n")
    (tmp_path / "mountinfo").write_text(
        f"35 31 0:32 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"32 31 0:29 {mount_root} {point} rw,relatime - cgroup cgroup rw,{controllers}\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def test_v2_quota_smaller_than_the_cores_caps_the_threads(tmp_path):
    cg, mi = _fake_v2(tmp_path, "200000 100000")
    quota = read_cpu_quota(cg, mi)
    assert quota.cpus == 2.0 and quota.source.endswith("kubepods/pod1/cpu.max")
    d = decide_cpu_threads(CpuFacts(tuple(range(64)), quota), env={})
    assert (d.cores_seen, d.quota_cpus, d.threads, d.bind) == (64, 2.0, 2, None)
    assert "quota" in d.why and "2 CPU threads" in d.describe() and "CPU quota 2" in d.describe()


def test_v2_fractional_quota_rounds_down_but_keeps_one_thread(tmp_path):
    cg, mi = _fake_v2(tmp_path, "150000 100000")
    d = decide_cpu_threads(CpuFacts((0, 1, 2, 3), read_cpu_quota(cg, mi)), env={})
    assert d.threads == 1 and d.quota_cpus == 1.5
    cg, mi = _fake_v2(tmp_path / "b", "50000 100000")
    assert decide_cpu_threads(CpuFacts((0, 1), read_cpu_quota(cg, mi)), env={}).threads == 1


def test_v2_no_limit_and_a_parents_limit(tmp_path):
    cg, mi = _fake_v2(tmp_path, "max 100000")
    assert read_cpu_quota(cg, mi) is None
    d = decide_cpu_threads(CpuFacts((0, 1, 2, 3), None), env={})
    assert (d.threads, d.quota_cpus, d.why) == (4, None, "the allowed cores")
    cg, mi = _fake_v2(tmp_path / "b", "max 100000", parent_cpu_max="100000 100000")  # the pod's limit binds
    assert read_cpu_quota(cg, mi).cpus == 1.0


def test_quota_larger_than_the_cores_leaves_one_thread_per_core(tmp_path):
    cg, mi = _fake_v2(tmp_path, "800000 100000")
    d = decide_cpu_threads(CpuFacts((0, 1), read_cpu_quota(cg, mi)), env={})
    assert (d.threads, d.quota_cpus, d.why) == (2, 8.0, "the allowed cores")


@pytest.mark.parametrize("mount_root", ["/", "/docker/abc"])
def test_v1_cfs_quota(tmp_path, mount_root):
    """v1: the cpu controller's mount (also when a container sees its own cgroup as the mount's root)."""
    cg, mi = _fake_v1(tmp_path, 100000, 100000, mount_root=mount_root)
    quota = read_cpu_quota(cg, mi)
    assert quota.cpus == 1.0 and quota.source.endswith("cpu.cfs_quota_us")
    assert decide_cpu_threads(CpuFacts((0, 1), quota), env={}).threads == 1


def test_v1_no_limit_and_a_cpu_only_hierarchy(tmp_path):
    cg, mi = _fake_v1(tmp_path, -1)
    assert read_cpu_quota(cg, mi) is None
    cg, mi = _fake_v1(tmp_path / "b", 300000, 100000, controllers="cpu")
    assert read_cpu_quota(cg, mi).cpus == 3.0


def test_nothing_readable_means_no_quota(tmp_path):
    assert read_cpu_quota(str(tmp_path / "missing"), str(tmp_path / "missing2")) is None
    (tmp_path / "loadavg").write_text("3.50 2.00 1.00 2/100 123\n")
    facts = read_cpu_facts(str(tmp_path / "missing"), str(tmp_path / "missing2"), str(tmp_path / "loadavg"),
                           affinity=(0, 1))
    assert facts == CpuFacts((0, 1), None, 3.5)


def test_the_users_threads_and_binding_win(tmp_path):
    facts = CpuFacts((0, 1, 2, 3), CpuQuota(1.0, "cpu.max"))
    assert decide_cpu_threads(facts, requested_threads=3, env={}).threads == 3  # the user's choice, quota or not
    d = decide_cpu_threads(facts, bind="2-3", env={})
    assert (d.threads, d.bind) == (2, (2, 3))
    d = decide_cpu_threads(CpuFacts((0, 1, 2, 3)), bind="auto", rank=1, world_size=2, env={})
    assert (d.threads, d.bind) == (2, (2, 3))


def test_ranks_split_the_cores_and_the_quota():
    assert decide_cpu_threads(CpuFacts(tuple(range(8))), world_size=2, env={}).threads == 4
    d = decide_cpu_threads(CpuFacts(tuple(range(8)), CpuQuota(4.0, "cpu.max")), world_size=4, env={})
    assert d.threads == 1
    assert decide_cpu_threads(CpuFacts((0,)), world_size=2, env={}).threads == 1


def test_wait_policy_names_the_users_choice():
    assert omp_wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE (the user's)"
    assert "GOMP_SPINCOUNT=1000" in omp_wait_policy({"GOMP_SPINCOUNT": "1000"})
    assert omp_wait_policy({}).startswith("libgomp default")
    assert decide_cpu_threads(CpuFacts((0, 1)), env={"OMP_WAIT_POLICY": "PASSIVE"}).wait_policy.startswith(
        "OMP_WAIT_POLICY=PASSIVE")


def test_passive_waits_on_a_host_loaded_at_start_up_unless_the_user_chose():
    loaded, quiet = CpuFacts((0, 1), None, 2.5), CpuFacts((0, 1), None, 1.2)
    env = choose_omp_environment(loaded, {}, online_cpus=2)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "2.5 >= 2 CPUs" in env[OMP_WAIT_REASON]
    assert "pagedllm: load average" in omp_wait_policy(env) and not omp_waits_spin(env)
    assert choose_omp_environment(quiet, {}, online_cpus=2) == {}  # libgomp's default: spin, then sleep
    assert choose_omp_environment(CpuFacts((0, 1)), {}, online_cpus=2) == {}  # load unknown
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        assert choose_omp_environment(loaded, user, online_cpus=2) == {}
        assert omp_wait_policy(user).endswith("(the user's)") and omp_waits_spin(user)


def test_apply_omp_environment_sets_nothing_once_torch_is_loaded(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    env = {}
    assert apply_omp_environment(env) == {} and env == {}


class _Host:
    """A fake clock, run-queue wait and idle time for ThreadGovernor."""

    def __init__(self):
        self.t, self.wait_ns, self.idle_s, self.threads = 0.0, 0, 0.0, []

    def advance(self, seconds, waited=0.0, idle=0.0):
        self.t += seconds
        self.wait_ns += int(waited * seconds * 1e9)
        self.idle_s += idle * seconds

    def governor(self, threads=2):
        return ThreadGovernor(threads, (0, 1), self.threads.append, window_s=0.5, clock=lambda: self.t,
                              run_wait=lambda: self.wait_ns, idle=lambda: self.idle_s)


def test_governor_drops_to_one_thread_when_oversubscribed_and_comes_back_when_free():
    host = _Host()
    gov = host.governor()
    gov.tick()  # the first sample
    for _ in range(3):  # quiet: nothing waits, the full count stays
        host.advance(0.6, waited=0.01)
        gov.tick()
    assert host.threads == [] and gov.current == 2
    host.advance(0.1, waited=0.9)
    gov.tick()  # within the window: no decision yet
    assert host.threads == []
    host.advance(0.5, waited=0.5)
    gov.tick()
    assert host.threads == [1] and gov.current == 1
    host.advance(0.6, waited=0.3, idle=0.0)  # still busy at one thread: stays
    gov.tick()
    host.advance(0.6, waited=0.0, idle=0.9)  # one window with a free core is not enough
    gov.tick()
    assert gov.current == 1
    host.advance(0.6, waited=0.0, idle=0.1)  # the streak is broken
    gov.tick()
    host.advance(0.6, waited=0.0, idle=0.9)
    gov.tick()
    assert gov.current == 1
    host.advance(0.6, waited=0.0, idle=0.9)
    gov.tick()
    assert host.threads == [1, 2] and gov.current == 2 and gov.switches == 2


def test_no_governor_for_the_users_threads_passive_waits_or_one_thread(monkeypatch):
    pytest.importorskip("torch")
    from pagedllm.config import EngineConfig

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    two = decide_cpu_threads(CpuFacts((0, 1)), env={})
    assert thread_governor(EngineConfig(), two) is not None
    assert thread_governor(EngineConfig(cpu_threads=2), two) is None
    assert thread_governor(EngineConfig(cpu_threads_adapt=False), two) is None
    assert thread_governor(EngineConfig(), decide_cpu_threads(CpuFacts((0,)), env={})) is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert thread_governor(EngineConfig(), two) is None


def test_run_wait_and_idle_readers(tmp_path):
    (tmp_path / "schedstat").write_text("123 456 7\n")
    assert read_thread_run_wait(str(tmp_path / "schedstat")) == 456
    assert read_thread_run_wait(str(tmp_path / "nope")) is None
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "stat").write_text(f"cpu  1 2 3 {9 * tick} 0 0 0\ncpu0 1 2 3 {4 * tick} {tick} 0 0\n"
                                   f"cpu1 1 2 3 {3 * tick} 0 0 0\ncpu2 1 2 3 {100 * tick} 0 0 0\n")
    assert read_idle_seconds((0, 1), str(tmp_path / "stat")) == 8.0
