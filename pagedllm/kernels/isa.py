"""Instruction-set levels of the CPU kernels, and which of them this CPU can run.

Each level is a set of CPU flags (as ``/proc/cpuinfo`` names them) and the compiler flags that
let the kernels' ``#if defined(__AVX2__)`` / ``__AVX512F__`` / ``__AVX512BF16__`` /
``__AMX_TILE__`` paths compile; a level includes every level below it. The choice is made at run
time from the CPU the process runs on (never ``-march=native``, never the build machine), so a
build cached on an AVX-512 machine is never loaded on an AVX2-only one (it would die with
SIGILL). AMX is only detected here: on Linux a kernel must request the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before its first tile instruction.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import FrozenSet, List, Optional


@dataclass(frozen=True)
class Level:
    name: str
    cpu_flags: tuple  # flags this CPU must report (cumulative)
    cxx_flags: tuple  # compiler flags of this level (cumulative)
    probe: str  # a C++ function using the level's newest instructions, to check the compiler accepts them


_AVX2_CPU = ("avx", "avx2", "fma", "f16c")
_AVX2_CXX = ("-mavx", "-mavx2", "-mfma", "-mf16c")
_AVX512_CPU = _AVX2_CPU + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")  # x86-64-v4
_AVX512_CXX = _AVX2_CXX + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")

# Lowest first. "scalar" is the compiler's default target: generic x86-64 (SSE2) or any other arch.
LEVELS = (
    Level("scalar", (), (), ""),
    Level("avx2", _AVX2_CPU, _AVX2_CXX,
          "__m256 f(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }"),
    Level("avx512", _AVX512_CPU, _AVX512_CXX,
          "__m512 f(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }"),
    Level("avx512_bf16", _AVX512_CPU + ("avx512_bf16",), _AVX512_CXX + ("-mavx512bf16",),
          "__m512 f(__m512 a, __m512bh b, __m512bh c) { return _mm512_dpbf16_ps(a, b, c); }"),
    Level("amx", _AVX512_CPU + ("avx512_bf16", "amx_tile", "amx_bf16"),
          _AVX512_CXX + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
          "void f(const void* cfg) { _tile_loadconfig(cfg); _tile_zero(0); _tile_dpbf16ps(0, 1, 2); _tile_release(); }"),
)
BY_NAME = {level.name: level for level in LEVELS}
NAMES = tuple(BY_NAME)

# Flags worth showing in a start-up line or a benchmark record, beside the levels' own.
_EXTRA_FLAGS = ("avx512_vnni", "avx512_fp16", "avx_vnni", "amx_int8")
RELEVANT_FLAGS = tuple(dict.fromkeys([f for level in LEVELS for f in level.cpu_flags] + list(_EXTRA_FLAGS)))

# torch.backends.cpu.get_cpu_capability() -> the flags it implies, where /proc/cpuinfo is missing.
_CAPABILITY_FLAGS = {
    "AVX2": _AVX2_CPU,
    "AVX512": _AVX512_CPU,
}


def level(name: str) -> Level:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown ISA level {name!r}; one of {', '.join(NAMES)}") from None


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")


def _cpuinfo() -> dict:
    """The first processor's ``flags`` and ``model name`` lines of /proc/cpuinfo ({} if none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "model name") and key not in info:
                    info[key] = value.strip()
                if len(info) == 2:
                    break
    except OSError:
        pass
    return info


@functools.lru_cache(maxsize=None)
def cpu_flags() -> FrozenSet[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo`` names; from torch's own detection where
    /proc is missing, e.g. macOS)."""
    flags = _cpuinfo().get("flags")
    if flags is not None:
        return frozenset(flags.split())
    try:
        import torch

        return frozenset(_CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()))
    except Exception:  # no torch, or an old one without get_cpu_capability
        return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def missing(lvl: Level, flags: Optional[FrozenSet[str]] = None) -> List[str]:
    """The CPU flags ``lvl`` needs that this CPU (or ``flags``) lacks; [] if it can run it."""
    if lvl.name != "scalar" and not is_x86():
        return ["x86-64"]
    have = cpu_flags() if flags is None else flags
    return [f for f in lvl.cpu_flags if f not in have]


def runnable(flags: Optional[FrozenSet[str]] = None) -> List[Level]:
    """The levels this CPU (or ``flags``) can run, highest first; always ends with scalar."""
    return [lvl for lvl in reversed(LEVELS) if not missing(lvl, flags)]


def best(flags: Optional[FrozenSet[str]] = None) -> Level:
    """The highest level the CPU can run (the compiler may still refuse it: see build.supports)."""
    return runnable(flags)[0]


def relevant_flags(flags: Optional[FrozenSet[str]] = None) -> List[str]:
    have = cpu_flags() if flags is None else flags
    return [f for f in RELEVANT_FLAGS if f in have]
