"""Every environment variable pagedllm reads, read here and nowhere else.

Settings a user may want are EngineConfig fields with CLI flags; the variables below are only
documented overrides of their defaults (a flag or an explicit argument always wins), plus the
API key, which operators prefer to keep out of process listings.

| variable                          | overrides the default of            |
|-----------------------------------|-------------------------------------|
| PAGEDLLM_CACHE_DIR                | EngineConfig.kernel_cache_dir       |
| PAGEDLLM_DISABLE_CPU_KERNELS=1    | EngineConfig.cpu_kernels (-> False) |
| PAGEDLLM_CPU_KEEP_FREED_MEMORY=0  | EngineConfig.cpu_keep_freed_memory  |
| PAGEDLLM_THREADS_PER_RANK=N       | EngineConfig.cpu_threads            |
| PAGEDLLM_CPU_THREADS_BIND=...     | EngineConfig.cpu_threads_bind       |
| PAGEDLLM_CPU_THREADS_ADAPT=0      | EngineConfig.cpu_threads_adapt (-> False) |
| PAGEDLLM_CPU_GEMM=auto|pagedllm|onednn | EngineConfig.cpu_gemm          |
| PAGEDLLM_NATIVE_DECODE=0          | EngineConfig.native_decode (-> False) |
| PAGEDLLM_ENGINE_CORE_PROCESS=0|1  | EngineConfig.engine_core_process    |
| PAGEDLLM_PP_LAYER_PARTITION=6,6   | EngineConfig.pp_layer_partition     |
| PAGEDLLM_API_KEY                  | ``pagedllm serve --api-key``        |
| CXX                               | the CPU kernels' compiler (c++)     |
| LOCAL_WORLD_SIZE (set by torchrun) | ranks sharing this host's memory    |
| TORCHELASTIC_RUN_ID, RANK, WORLD_SIZE, LOCAL_RANK (set by torchrun) | a multi-node rank: its place and its GPU |
| PAGEDLLM_PARENT_PIPE_FD (set by `serve --data-parallel-size`) | a replica's pipe to its launcher (it stops when the launcher dies) |
| OPENAI_API_KEY                    | ``pagedllm bench serve``'s key (else PAGEDLLM_API_KEY) |
| CUDA_VISIBLE_DEVICES              | GPUs split across data-parallel replicas |
| OMP_WAIT_POLICY, GOMP_SPINCOUNT   | OpenMP's idle threads; when neither is set, pagedllm sets OMP_WAIT_POLICY=PASSIVE on a host whose load average is at or above its CPUs at start-up (worker/cpu_threads.choose_omp_environment) |
"""
from __future__ import annotations

import os
from typing import Optional


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def cache_dir() -> str:
    """pagedllm's cache: $PAGEDLLM_CACHE_DIR or ~/.cache/pagedllm (built kernels, GGUF metadata)."""
    return _get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def kernel_cache_dir() -> str:
    """Where built kernels are cached: $PAGEDLLM_CACHE_DIR/kernels or ~/.cache/pagedllm/kernels."""
    return os.path.join(cache_dir(), "kernels")


def cpu_kernels_enabled() -> bool:
    return _get("PAGEDLLM_DISABLE_CPU_KERNELS") != "1"


def native_decode() -> bool:
    return _get("PAGEDLLM_NATIVE_DECODE") not in ("0", "false", "no", "off")


def engine_core_process() -> Optional[bool]:
    """PAGEDLLM_ENGINE_CORE_PROCESS as a boolean; None when unset (each entry point's default)."""
    value = _get("PAGEDLLM_ENGINE_CORE_PROCESS")
    return None if value is None else value.lower() not in ("0", "false", "no", "off")


def pp_layer_partition() -> Optional[str]:
    return _get("PAGEDLLM_PP_LAYER_PARTITION")


def cxx() -> str:
    """The C++ compiler (with any leading words, e.g. "ccache g++") the CPU kernels are built with."""
    return _get("CXX") or "c++"


def cpu_keep_freed_memory() -> bool:
    return _get("PAGEDLLM_CPU_KEEP_FREED_MEMORY") != "0"


def cpu_threads() -> Optional[int]:
    value = _get("PAGEDLLM_THREADS_PER_RANK")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"PAGEDLLM_THREADS_PER_RANK must be an integer, got {value!r}") from None


def cpu_threads_bind() -> Optional[str]:
    return _get("PAGEDLLM_CPU_THREADS_BIND")


def cpu_threads_adapt() -> bool:
    return _get("PAGEDLLM_CPU_THREADS_ADAPT") != "0"


def cpu_gemm() -> str:
    return _get("PAGEDLLM_CPU_GEMM") or "auto"


def api_key() -> Optional[str]:
    return _get("PAGEDLLM_API_KEY")


def local_world_size() -> Optional[int]:
    """Ranks on this host when torchrun launched the process (they share its memory), else None."""
    value = _get("LOCAL_WORLD_SIZE")
    try:
        return int(value) if value is not None and int(value) >= 1 else None
    except ValueError:
        return None


def torchrun_rank() -> Optional[tuple[int, int]]:
    """(RANK, WORLD_SIZE) of a process torchrun launched (TORCHELASTIC_RUN_ID set), else None."""
    if _get("TORCHELASTIC_RUN_ID") is None:
        return None
    try:
        return int(_get("RANK") or 0), int(_get("WORLD_SIZE") or 1)
    except ValueError:
        raise ValueError(f"torchrun's RANK / WORLD_SIZE must be integers, got {_get('RANK')!r} / "
                         f"{_get('WORLD_SIZE')!r}") from None


def local_rank(default: int) -> int:
    """This rank's GPU on its host: LOCAL_RANK (torchrun), else ``default``."""
    value = _get("LOCAL_RANK")
    return default if value is None else int(value)


PARENT_PIPE_FD = "PAGEDLLM_PARENT_PIPE_FD"  # a data-parallel replica: the read end of its launcher's pipe


def take_parent_pipe_fd() -> Optional[int]:
    """The replica's pipe to its launcher, once (the variable is removed: children do not inherit it)."""
    value = os.environ.pop(PARENT_PIPE_FD, None)
    return int(value) if value not in (None, "") else None


def openai_api_key() -> Optional[str]:
    return _get("OPENAI_API_KEY")


def cuda_visible_devices() -> Optional[list[str]]:
    """The GPUs this process may use as CUDA_VISIBLE_DEVICES lists them (None: unset, all)."""
    value = _get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]
