"""How much host memory the CPU worker may give its KV cache, and the start-up plan it logs.

The memory available to this process is the smaller of the host's ``MemAvailable``
(/proc/meminfo) and what its cgroup still allows (cgroup v2 ``memory.max`` minus
``memory.current``, or v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``, each less
the reclaimable file cache in ``memory.stat``; every cgroup on the path up to the root counts).
It is measured after the weights are loaded, so they are already out of it. The KV cache gets
``cpu_memory_utilization`` of it, shared evenly by the tensor-parallel ranks on this host, less
an estimate of one step's activations; ``kv_cache_memory`` overrides all of this.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pagedllm.config import attention_heads, hf_field

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class HostMemory:
    mem_available: Optional[int]  # bytes, /proc/meminfo MemAvailable
    cgroup_limit: Optional[int] = None  # the tightest limit on the path (None: none)
    cgroup_free: Optional[int] = None  # that cgroup's limit minus its non-reclaimable usage

    @property
    def available(self) -> int:
        values = [v for v in (self.mem_available, self.cgroup_free) if v is not None]
        return max(0, min(values)) if values else 0

    def describe(self) -> str:
        parts = [f"MemAvailable {gib(self.mem_available)}" if self.mem_available is not None else "no /proc/meminfo"]
        if self.cgroup_limit is not None:
            parts.append(f"cgroup limit {gib(self.cgroup_limit)}, {gib(self.cgroup_free)} of it free")
        return "; ".join(parts)


def gib(n: Optional[int]) -> str:
    if n is None:
        return "?"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _stat(text: Optional[str], key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _mem_available(root: str) -> Optional[int]:
    for line in (_read(os.path.join(root, "proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * (1024 if len(parts) < 3 or parts[2].lower() == "kb" else 1)
    return None


def _cgroup_dirs(root: str, version: int) -> list[str]:
    """This process's cgroup directory and its ancestors (deepest first), that exist."""
    base = os.path.join(root, "sys/fs/cgroup") if version == 2 else os.path.join(root, "sys/fs/cgroup/memory")
    rel = "/"
    for line in (_read(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if (version == 2 and controllers == "") or (version == 1 and "memory" in controllers.split(",")):
            rel = path.strip() or "/"
            break
    dirs, rel = [], rel.strip("/")
    while True:
        d = os.path.join(base, rel) if rel else base
        if os.path.isdir(d):
            dirs.append(d)
        if not rel:
            break
        rel = os.path.dirname(rel)
    if base not in dirs and os.path.isdir(base):
        dirs.append(base)
    return dirs


def _cgroup(root: str) -> tuple[Optional[int], Optional[int]]:
    """(tightest limit, free under it) over this process's cgroup and its ancestors."""
    best: tuple[Optional[int], Optional[int]] = (None, None)
    for version, limit_file, usage_file, inactive in ((2, "memory.max", "memory.current", "inactive_file"),
                                                       (1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                        "total_inactive_file")):
        for d in _cgroup_dirs(root, version):
            limit = _int(_read(os.path.join(d, limit_file)))
            if limit is None:
                continue
            usage = _int(_read(os.path.join(d, usage_file))) or 0
            usage -= min(usage, _stat(_read(os.path.join(d, "memory.stat")), inactive))
            free = max(0, limit - usage)
            if best[1] is None or free < best[1]:
                best = (limit, free)
        if best[0] is not None:
            return best
    return best


def read_host_memory(root: str = "/") -> HostMemory:
    """The memory this process may still use (``root`` lets tests point at a fake /proc and /sys)."""
    limit, free = _cgroup(root)
    return HostMemory(_mem_available(root), limit, free)


def estimate_activation_bytes(hf_config, num_tokens: int, max_num_seqs: int, elem_bytes: int, tp: int,
                              max_model_len: int, torch_attention: bool) -> int:
    """An upper-side estimate (not a measurement) of one step's activation memory on CPU: per token
    the hidden states, q/k/v, attention output and the MLP's gate/up and activated halves; the
    logits (float32, plus the sampler's copy) of the sampled rows; with the pure-torch attention
    (no C++ kernels) also one query chunk's scores (256 positions) against the longest context.
    Doubled for temporaries and the allocator."""
    h = hf_config.hidden_size
    inter = hf_field(hf_config, "intermediate_size") or 4 * h
    heads, kv_heads, head_dim = attention_heads(hf_config)
    per_token = 5 * h + (2 * heads + 2 * kv_heads) * head_dim // tp + 3 * inter // tp
    logits = min(num_tokens, max_num_seqs) * hf_config.vocab_size * 4 * 2
    scores = min(256, num_tokens) * max(1, heads // tp) * max_model_len * 4 * 2 if torch_attention else 0
    return 2 * (num_tokens * per_token * elem_bytes + logits + scores)


def cpu_kv_budget(host: HostMemory, utilization: float, ranks_on_host: int, activations: int) -> int:
    """Bytes this rank's KV cache may take: its share of ``utilization`` x available, less activations."""
    return max(0, int(host.available * utilization) // max(1, ranks_on_host) - activations)
