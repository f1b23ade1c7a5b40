"""Which packed GEMM each linear-layer shape runs on this CPU: pagedllm's own
(``kernels/csrc/packed_gemm.h``) or oneDNN's (through torch), chosen by timing both.

Neither wins everywhere. On the 2-core AVX512-BF16 EPYC ours is 9% ahead for single rows and
oneDNN 4-8% ahead from 512 rows up; on CPUs with AMX tiles oneDNN's bf16 products at prefill sizes
run on the tiles, which pagedllm's kernels do not use, and a CPU this project has not seen may
differ again. So at start-up (``EngineConfig.cpu_gemm = "auto"``) every distinct (out, in) shape
of the model's packable layers is timed through both packed forms at 1, 64 and 512 rows (decode,
batched decode, prefill chunk) with random weights, best of a few alternating runs, and oneDNN's
form is used for a shape when the geometric mean of its speed-ups over the three row counts is
above ``MARGIN`` (each regime weighs the same in relative terms; ties keep ours, whose batch-1
path the decode-bandwidth figures rest on). The margin is 20%: on the AVX512-BF16 EPYC a 5%
margin gave llama-100m's gate/up and LM head shapes to oneDNN (isolated speed-ups 1.11 and 1.11)
and the whole 64-request run came out 2.5% slower (10.58 / 10.42 / 10.01 s vs 10.16 / 9.96 /
10.11 s with ours everywhere, alternating), so only a clear win such as AMX tiles moves a shape. One form per layer: holding both would double the
weights' memory.

Choices are cached on disk per CPU (model name and ISA flags), torch version, kernel level,
thread count and dtype, one JSON file per key under the kernel cache directory, so a model's
shapes are timed once per machine. A shape whose samples spread more than ``NOISY``, or any
shape timed while the load average is above the CPUs this process may use (other processes had
the cores), is decided for this process only and timed again at the next start, so a busy moment
is never remembered. ``"pagedllm"`` / ``"onednn"`` force one form for every shape.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

ROWS = (1, 64, 512)
MARGIN = 1.2  # see the module docstring: isolated timings 5-11% apart did not carry over to the model
ROUNDS = 5
NOISY = 1.3  # second-best / best sample of a cell above this: the machine was busy, do not cache
CHOICES = ("auto", "pagedllm", "onednn")
_decided: dict[tuple, str] = {}  # (cache key, shape) -> choice made in this process (cached or not)


@dataclass(frozen=True)
class ShapeTiming:
    """Best seconds per product of one [out, in] weight at each of ROWS, through each form."""
    out_features: int
    in_features: int
    pagedllm_s: tuple[float, ...]
    onednn_s: tuple[float, ...]
    noisy: bool = False  # some cell's samples spread more than NOISY: timed on a busy machine

    @property
    def onednn_speedup(self) -> float:
        """Geometric mean over the row counts of pagedllm time / oneDNN time."""
        ratios = [p / max(o, 1e-12) for p, o in zip(self.pagedllm_s, self.onednn_s)]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    @property
    def choice(self) -> str:
        return "onednn" if self.onednn_speedup > MARGIN else "pagedllm"


def cache_key(dtype: torch.dtype, kernels_level: str) -> str:
    """What a timing depends on besides the shape: the CPU, torch (oneDNN's version), our kernel
    level, the threads and the dtype."""
    from pagedllm.kernels import isa

    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    parts = [cpu_model, " ".join(sorted(isa.cpu_flags())), torch.__version__, kernels_level,
             str(torch.get_num_threads()), str(dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def machine_busy() -> bool:
    """Other processes hold the cores: the 1-minute load average is above the CPUs this process
    may use (a busy machine times both forms slowly and evenly, which the spread check misses)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        return os.getloadavg()[0] > cpus
    except OSError:
        return False


def time_shape(n: int, k: int, dtype: torch.dtype, pack_ours: Callable, pack_onednn: Callable, linear: Callable,
               clock: Callable[[], float] = time.perf_counter) -> ShapeTiming:
    """Times ``linear`` through both packed forms of a random [n, k] weight at each of ROWS."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    forms = (pack_ours(w), pack_onednn(w))
    samples = [[[] for _ in ROWS] for _ in forms]
    for r, m in enumerate(ROWS):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for form in forms:
            linear(x, form)  # warm-up
        for _ in range(ROUNDS):
            for f, form in enumerate(forms):
                t = clock()
                linear(x, form)
                samples[f][r].append(clock() - t)
    cells = [sorted(c) for form in samples for c in form]
    noisy = any(c[1] > NOISY * max(c[0], 1e-9) for c in cells)
    return ShapeTiming(n, k, tuple(min(c) for c in samples[0]), tuple(min(c) for c in samples[1]), noisy)


def select_forms(shapes: Iterable[tuple[int, int]], dtype: torch.dtype, mode: str, cache_dir: Optional[str],
                 kernels_level: str, pack_ours: Callable, pack_onednn: Callable, linear: Callable,
                 clock: Callable[[], float] = time.perf_counter) -> dict[tuple[int, int], str]:
    """{(out, in): "pagedllm" | "onednn"} for every shape; ``mode`` "auto" times the shapes the
    on-disk cache does not hold yet (and stores them), the others force one form."""
    shapes = sorted(set(shapes))
    if mode not in CHOICES:
        raise ValueError(f"cpu_gemm must be one of {CHOICES}, got {mode!r}")
    if mode != "auto":
        return {s: mode for s in shapes}
    key = cache_key(dtype, kernels_level)
    path = None
    cached: dict = {}
    if cache_dir:
        path = os.path.join(cache_dir, "gemm_select", f"{key}.json")
        try:
            with open(path) as f:
                cached = json.load(f)
        except (OSError, ValueError):
            cached = {}
    choices = {s: cached[f"{s[0]}x{s[1]}"]["choice"] for s in shapes if f"{s[0]}x{s[1]}" in cached}
    choices.update({s: _decided[(key, s)] for s in shapes if s not in choices and (key, s) in _decided})
    missing = [s for s in shapes if s not in choices]
    if missing:
        t0 = time.perf_counter()
        busy = machine_busy()
        noisy = []
        for n, k in missing:
            t = time_shape(n, k, dtype, pack_ours, pack_onednn, linear, clock)
            choices[(n, k)] = _decided[(key, (n, k))] = t.choice
            if t.noisy or busy:  # decided for this process only; timed again at the next start
                noisy.append(f"{n}x{k}")
                continue
            cached[f"{n}x{k}"] = {"choice": t.choice, "onednn_speedup": round(t.onednn_speedup, 3),
                                  "rows": list(ROWS), "pagedllm_us": [round(s * 1e6, 1) for s in t.pagedllm_s],
                                  "onednn_us": [round(s * 1e6, 1) for s in t.onednn_s]}
        logger.info("CPU GEMM: timed %d weight shapes against oneDNN in %.2f s%s", len(missing),
                    time.perf_counter() - t0, f" (busy machine: {', '.join(noisy)} not cached)" if noisy else "")
        if path and len(noisy) < len(missing):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(cached, f, indent=1)
                os.replace(tmp, path)
            except OSError as e:  # a read-only cache only costs the timing again next start
                logger.warning("CPU GEMM: could not cache the choices in %s: %s", path, e)
    return choices
