"""CPU threads of one rank: how many, which cores they run on, and how OpenMP's idle threads wait.

The decision is made from what the process may really use, not from the cores it can see: its
affinity mask, the CPU quota of its cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, the smallest along the path up to the hierarchy's root) and the user's
``cpu_threads`` / ``cpu_threads_bind``. torch alone starts one thread per visible core, so a
container limited to 2 CPUs on a 64-core node would run 64 threads inside a 2-CPU quota.

``read_cpu_facts`` reads the facts (every path injectable, for tests); ``decide_cpu_threads`` is
a pure function of them; ``configure_cpu_threads`` applies the decision in a worker. Importing
this module does not import torch (the CLI decides OpenMP's environment before torch loads).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from pagedllm.config import EngineConfig, cpu_bind_for_rank

logger = logging.getLogger(__name__)

# Environment variables libgomp reads once, when it loads (with torch): the user's choice wins.
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class CpuQuota:
    """A CFS bandwidth limit: ``cpus`` = quota / period (1.5 = one and a half CPUs of time)."""
    cpus: float
    source: str  # the file it was read from


@dataclass(frozen=True)
class CpuFacts:
    """What this process may use: the CPUs of its affinity mask and its cgroup's CPU quota."""
    affinity: tuple[int, ...]
    quota: Optional[CpuQuota] = None
    load_average: Optional[float] = None  # 1-minute, /proc/loadavg (recorded, not decided on)


@dataclass(frozen=True)
class CpuThreadDecision:
    """How many intra-op threads one rank runs, bound to which CPUs, and why."""
    cores_seen: int  # CPUs in the affinity mask
    quota_cpus: Optional[float]  # the cgroup's quota in CPUs, None without one
    threads: int
    bind: Optional[tuple[int, ...]]  # CPUs the rank is bound to, None: the OS schedules
    wait_policy: str  # how OpenMP's idle threads wait (see omp_wait_policy)
    why: str

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota_cpus is None else f"CPU quota {self.quota_cpus:g}"
        bind = f", bound to CPUs {_cpu_list(self.bind)}" if self.bind else ""
        return (f"{self.threads} CPU threads{bind} ({self.cores_seen} cores allowed, {quota}; {self.why}); "
                f"OpenMP waits: {self.wait_policy}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cpu_list(cpus) -> str:
    return ",".join(str(c) for c in cpus)


# -- reading the facts -------------------------------------------------------------------------------

def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup/cgroup2 mount in a mountinfo file."""
    found = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return found


def _cgroup_dir(mount_root: str, mount_point: str, path: str) -> str:
    """The directory of cgroup ``path`` (as /proc/self/cgroup names it) under a mount of the hierarchy at ``mount_root``."""
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]  # a container sees its own cgroup as the mount's root
    return os.path.join(mount_point, path.lstrip("/"))


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _quota_along(directory: str, mount_point: str, read_one) -> Optional[CpuQuota]:
    """The smallest quota from ``directory`` up to ``mount_point`` (a parent's limit binds its children)."""
    best = None
    mount_point = os.path.normpath(mount_point)
    d = os.path.normpath(directory)
    while True:
        q = read_one(d)
        if q is not None and (best is None or q.cpus < best.cpus):
            best = q
        if d == mount_point or len(d) <= len(mount_point):
            return best
        d = os.path.dirname(d)


def _v2_quota(d: str) -> Optional[CpuQuota]:
    text = _read(os.path.join(d, "cpu.max"))
    if not text:
        return None
    parts = text.split()
    if parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100000
    except ValueError:
        return None
    return CpuQuota(quota / period, os.path.join(d, "cpu.max")) if quota > 0 and period > 0 else None


def _v1_quota(d: str) -> Optional[CpuQuota]:
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    try:
        quota_us, period_us = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:  # -1: no limit
        return None
    return CpuQuota(quota_us / period_us, os.path.join(d, "cpu.cfs_quota_us"))


def read_cpu_quota(cgroup_file: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> Optional[CpuQuota]:
    """This process's CPU quota: the smallest of its cgroup v2 ``cpu.max`` and v1 CFS quota along
    its cgroup's path (found through ``cgroup_file`` and the cgroup mounts in ``mountinfo``), or
    None when no limit is set or nothing can be read."""
    text = _read(cgroup_file)
    if not text:
        return None
    mounts = _mounts(mountinfo)
    quotas = []
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hier == "0" and controllers == "":  # the unified (v2) hierarchy
            for root, point, fstype, _opts in mounts:
                if fstype == "cgroup2":
                    quotas.append(_quota_along(_cgroup_dir(root, point, path), point, _v2_quota))
        elif "cpu" in controllers.split(","):
            for root, point, fstype, opts in mounts:
                if fstype == "cgroup" and "cpu" in opts:
                    quotas.append(_quota_along(_cgroup_dir(root, point, path), point, _v1_quota))
    quotas = [q for q in quotas if q is not None]
    return min(quotas, key=lambda q: q.cpus) if quotas else None


def _load_average(loadavg: str) -> Optional[float]:
    text = _read(loadavg)
    try:
        return float(text.split()[0]) if text else None
    except ValueError:
        return None


def read_cpu_facts(cgroup_file: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo",
                   loadavg: str = "/proc/loadavg", affinity: Optional[tuple[int, ...]] = None) -> CpuFacts:
    if affinity is None:
        try:
            affinity = tuple(sorted(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            affinity = tuple(range(os.cpu_count() or 1))
    return CpuFacts(affinity, read_cpu_quota(cgroup_file, mountinfo), _load_average(loadavg))


# -- the decision ------------------------------------------------------------------------------------

def omp_wait_policy(env: Mapping[str, str]) -> str:
    """How libgomp's idle threads wait in a process started with ``env``: OMP_WAIT_POLICY /
    GOMP_SPINCOUNT (the user's, or pagedllm's with its reason), else libgomp's default (spin ~300k
    iterations, then sleep)."""
    chosen = [f"{k}={env[k]}" for k in OMP_WAIT_VARIABLES if env.get(k)]
    if not chosen:
        return "libgomp default (spin, then sleep)"
    reason = env.get(OMP_WAIT_REASON)
    return " ".join(chosen) + (f" (pagedllm: {reason})" if reason else " (the user's)")


def omp_waits_spin(env: Mapping[str, str]) -> bool:
    """Whether libgomp's idle threads spin before sleeping in a process started with ``env``."""
    return env.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE" and env.get("GOMP_SPINCOUNT") not in ("0",)


# Set beside OMP_WAIT_POLICY when pagedllm chose it (why), so ranks and replicas, which inherit the
# environment, report it as pagedllm's choice and not the user's.
OMP_WAIT_REASON = "PAGEDLLM_OMP_WAIT_REASON"


def choose_omp_environment(facts: CpuFacts, env: Mapping[str, str], online_cpus: Optional[int] = None) -> dict[str, str]:
    """The OpenMP environment to set before torch (and libgomp) loads; {} to leave libgomp's default.

    libgomp reads its wait policy once, at load. Its default spins an idle thread ~300k iterations
    (~ms) before sleeping: fastest on cores of our own (a parallel region starts and ends without a
    futex wake; 1.3-1.5x on small models, docs/benchmarks.md issue 15), and ruinous on oversubscribed
    ones, where a thread spins through its time slice waiting for a partner the scheduler took off
    its core at every region (10-25x, issue 30). So: passive waiting when the host is oversubscribed
    when the engine starts (the 1-minute load average at or above the online CPUs); else libgomp's
    default, and ThreadGovernor takes the engine to one thread if the cores get oversubscribed later
    (a wait policy cannot change once libgomp has loaded). The user's OMP_WAIT_POLICY or
    GOMP_SPINCOUNT always wins (OMP_WAIT_POLICY=ACTIVE / PASSIVE, or GOMP_SPINCOUNT=300000 for libgomp's
    default even on a loaded host).
    """
    if any(env.get(k) for k in OMP_WAIT_VARIABLES):
        return {}
    cpus = online_cpus or os.cpu_count() or len(facts.affinity) or 1
    if facts.load_average is not None and facts.load_average >= cpus:
        return {"OMP_WAIT_POLICY": "PASSIVE",
                OMP_WAIT_REASON: f"load average {facts.load_average:g} >= {cpus} CPUs at start-up"}
    return {}


def apply_omp_environment(env=None) -> dict[str, str]:
    """choose_omp_environment for this process, applied to ``env`` (os.environ) if torch has not
    loaded yet (after that libgomp would not read it). Returns what was set."""
    import sys

    env = os.environ if env is None else env
    if "torch" in sys.modules:
        return {}
    chosen = choose_omp_environment(read_cpu_facts(), env)
    env.update(chosen)
    return chosen


def decide_cpu_threads(facts: CpuFacts, requested_threads: Optional[int] = None, bind: Optional[str] = None,
                       rank: int = 0, world_size: int = 1, env: Optional[Mapping[str, str]] = None) -> CpuThreadDecision:
    """Threads and binding for ``rank`` of ``world_size`` ranks sharing this host.

    ``requested_threads`` (cpu_threads) wins; else a binding's CPU count; else the allowed CPUs
    split across the ranks, capped by the quota (rounded down, at least 1): a thread more than
    the quota allows is throttled, and its partners wait for it at every parallel region.
    """
    env = os.environ if env is None else env
    cpus = cpu_bind_for_rank(bind, rank, world_size, list(facts.affinity))
    quota = facts.quota.cpus if facts.quota is not None else None
    cores = len(facts.affinity)
    if requested_threads is not None:
        threads, why = requested_threads, "cpu_threads"
    elif cpus is not None:
        threads, why = len(cpus), "one per bound CPU"
    else:
        share = max(1, cores // world_size)
        why = "the allowed cores" if world_size == 1 else f"the allowed cores / {world_size} ranks"
        threads = share
        if quota is not None:
            by_quota = max(1, math.floor(quota / world_size + 1e-9))
            if by_quota < share:
                threads = by_quota
                why = f"the CPU quota ({facts.quota.source})" + ("" if world_size == 1 else f" / {world_size} ranks")
    return CpuThreadDecision(cores, quota, threads, tuple(cpus) if cpus is not None else None,
                             omp_wait_policy(env), why)


# -- applying it in a worker -------------------------------------------------------------------------

def configure_cpu_threads(config: EngineConfig, rank: int, world_size: int,
                          facts: Optional[CpuFacts] = None) -> CpuThreadDecision:
    """Bind this process to its CPUs (if asked) and set torch's intra-op thread count.

    Called before the model is built, so the OpenMP pool is created afterwards and its threads
    inherit the binding. Returns the decision (logged).
    """
    import torch

    facts = read_cpu_facts() if facts is None else facts
    decision = decide_cpu_threads(facts, config.cpu_threads, config.cpu_threads_bind, rank, world_size)
    if decision.bind is not None:
        try:
            os.sched_setaffinity(0, decision.bind)
        except (AttributeError, OSError) as e:
            raise ValueError(f"cpu_threads_bind: cannot bind rank {rank} to CPUs {list(decision.bind)}: {e}") from e
    if torch.get_num_threads() != decision.threads:
        torch.set_num_threads(decision.threads)
    logger.info("rank %d: %s", rank, decision.describe())
    return decision


# -- fewer threads while the cores are oversubscribed --------------------------------------------

def read_thread_run_wait(path: str = "/proc/thread-self/schedstat") -> Optional[int]:
    """Nanoseconds the calling thread has waited on a run queue (runnable, not running), or None."""
    text = _read(path)
    try:
        return int(text.split()[1]) if text else None
    except (IndexError, ValueError):
        return None


def read_idle_seconds(cpus: tuple[int, ...], path: str = "/proc/stat") -> Optional[float]:
    """Idle + iowait seconds so far of ``cpus`` (from /proc/stat's per-CPU lines), or None."""
    text = _read(path)
    if not text:
        return None
    want, total, tick = {f"cpu{c}" for c in cpus}, 0, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in want and len(parts) > 5:
            total += int(parts[4]) + int(parts[5])
    return total / tick


class ThreadGovernor:
    """One intra-op thread while the cores are oversubscribed, all of them again once they are free.

    libgomp reads its wait policy once, when it loads; what can change at run time is the thread
    count. With more runnable threads than cores, a parallel region's threads wait for a partner
    the scheduler took off its core (spinning through its time slice, or sleeping and paying a
    wake-up), at every one of a step's parallel regions; one thread has no partner to wait for.

    ``tick()`` runs before each step on the thread that runs the forward (OpenMP's thread count is
    per calling thread). Every ``window_s`` it looks at two facts: the fraction of the window this
    thread waited on a run queue (above ``enter``: oversubscribed, go to one thread), and, while at
    one thread, the idle time of the allowed CPUs (at least ``leave_idle`` of a core per thread to
    add, over ``leave_windows`` windows running: the other threads would find free cores).
    """

    def __init__(self, threads: int, cpus: tuple[int, ...], set_threads, window_s: float = 0.5,
                 enter: float = 0.2, leave_idle: float = 0.6, leave_windows: int = 2,
                 clock=None, run_wait=read_thread_run_wait, idle=None) -> None:
        import time

        self.full = threads
        self.current = threads
        self.window_s, self.enter, self.leave_idle, self.leave_windows = window_s, enter, leave_idle, leave_windows
        self._set_threads, self._clock, self._run_wait = set_threads, clock or time.monotonic, run_wait
        self._idle = idle or (lambda: read_idle_seconds(cpus))
        self._t0 = None
        self._free_windows = 0
        self.switches = 0

    def _sample(self):
        return self._clock(), self._run_wait(), self._idle()

    def tick(self) -> None:
        now = self._clock()
        if self._t0 is not None and now - self._t0[0] < self.window_s:
            return
        sample = self._sample()
        if self._t0 is None or sample[1] is None or self._t0[1] is None:
            self._t0 = sample
            return
        (t0, w0, i0), (t1, w1, i1) = self._t0, sample
        self._t0 = sample
        wall = t1 - t0
        waited = (w1 - w0) / 1e9 / wall
        if self.current == self.full:
            if waited > self.enter:
                self._switch(1)
            return
        idle = (i1 - i0) / wall if i0 is not None and i1 is not None else 0.0
        self._free_windows = self._free_windows + 1 if idle >= self.leave_idle * (self.full - 1) else 0
        if self._free_windows >= self.leave_windows:
            self._switch(self.full)

    def _switch(self, threads: int) -> None:
        self._set_threads(threads)
        self.current, self._free_windows = threads, 0
        self.switches += 1
        logger.info("CPU threads %d -> %d (%s)", self.full if threads == 1 else 1, threads,
                    "the cores are oversubscribed" if threads == 1 else "the cores are free again")


def thread_governor(config: EngineConfig, decision: CpuThreadDecision) -> Optional[ThreadGovernor]:
    """The governor of a rank's threads, or None where there is nothing to adapt: one thread,
    passive OpenMP waits, the user's own cpu_threads, or cpu_threads_adapt off."""
    if (not config.cpu_threads_adapt or config.cpu_threads is not None or decision.threads < 2
            or not omp_waits_spin(os.environ)):  # passive waits already cost little on shared cores
        return None
    import torch

    cpus = decision.bind or tuple(sorted(os.sched_getaffinity(0)))
    return ThreadGovernor(decision.threads, cpus, torch.set_num_threads)
