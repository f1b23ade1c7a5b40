"""Optional C++ CPU kernels (csrc/), built per instruction-set level on first use and cached on disk.

``load()`` picks the highest level this CPU can run (``isa.py``: scalar, avx2, avx512,
avx512_bf16, amx -- detected from /proc/cpuinfo at run time, never from the build machine) and
imports its cached build, building it first if needed (``build.py``: small translation units
compiled in parallel; the cache key names the level, the compiler, torch, Python and the
sources). A level the compiler refuses, or whose build failed before (remembered on disk), falls
back to the next lower one, down to scalar.

If nothing can be built or loaded (no compiler), ``load()`` returns None and every caller keeps
its pure-torch path (``for_tensor`` is how layers ask); both paths are tested against each other.
``describe()`` says what was chosen, for start-up lines and benchmark records.

``python -m pagedllm.kernels.cpu`` prebuilds (``make`` does this; it retries remembered
failures); ``--all-isas`` builds every level the compiler supports (container images, whose
CPUs are not known at build time); ``--isa LEVEL`` builds and loads one level.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from typing import Optional

from pagedllm import envs
from pagedllm.kernels import build, isa

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_module = None
_tried = False
_warned = set()  # failure markers already warned about in this process


def _import(path: str, level: isa.Level):
    name = build.module_name(level)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _check_runnable(level: isa.Level) -> None:
    lacking = isa.missing(level)
    if lacking:
        raise ValueError(f"this CPU ({isa.cpu_model()}) cannot run the {level.name} kernels: it lacks "
                         f"{', '.join(lacking)}")


def select_and_load(cache_dir: Optional[str] = None, level: Optional[str] = None, retry_failed: bool = False):
    """Import (building if needed) the highest level this CPU can run, or exactly ``level``
    (ValueError if this CPU cannot run it); None if none can be built. No process-wide state:
    ``load()`` is the cached entry point."""
    cache_dir = cache_dir or envs.kernel_cache_dir()
    if level is not None:
        candidates = [isa.level(level)]
        _check_runnable(candidates[0])
    else:
        candidates = isa.runnable()
    comp = build.compiler()
    skipped = []
    for lvl in candidates:
        path = build.cached(cache_dir, lvl, comp)
        if path is None:
            if comp is None:
                skipped.append(f"{lvl.name}: no C++ compiler ({envs.cxx()}) and no cached build")
                continue
            failed = build.failure(cache_dir, lvl, comp)
            if failed is not None and not retry_failed:
                marker = build.failure_path(cache_dir, lvl, comp)
                if marker not in _warned:
                    _warned.add(marker)
                    logger.warning("CPU kernels: %s skipped, it failed before (%s; details in %s)", lvl.name,
                                   failed.splitlines()[0], marker)
                skipped.append(f"{lvl.name}: failed before")
                continue
            try:
                logger.info("CPU kernels: building %s with %s into %s", lvl.name, comp.description, cache_dir)
                path = build.build(cache_dir, lvl, comp)
            except build.BuildError as e:
                logger.warning("CPU kernels: %s", e)
                skipped.append(f"{lvl.name}: build failed")
                continue
        try:
            module = _import(path, lvl)
        except ImportError as e:
            logger.warning("CPU kernels: cannot import the %s build %s: %s", lvl.name, path, e)
            skipped.append(f"{lvl.name}: import failed")
            continue
        if skipped:
            logger.info("CPU kernels: using %s (%s)", lvl.name, "; ".join(skipped))
        return module
    logger.warning("CPU kernels unavailable (%s); using the pure-torch path", "; ".join(skipped))
    return None


def load(cache_dir: Optional[str] = None, isa_level: Optional[str] = None):
    """Build (once per machine and level, cached under ``cache_dir``: EngineConfig.kernel_cache_dir)
    and import the kernels for this CPU, once per process; None when that is impossible."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            _module = select_and_load(cache_dir, isa_level)
        except ValueError:
            raise
        except Exception as e:  # anything else: fall back to the torch path
            logger.warning("CPU kernels unavailable (%s); using the pure-torch path", e)
            _module = None
        _tried = True
        return _module


def ready():
    """The module if it has finished loading, else None (never blocks)."""
    return _module if _tried else None


_DTYPES = ("torch.float32", "torch.bfloat16")


def for_tensor(t):
    """The kernels module if it is loaded and handles ``t`` (a CPU float32/bfloat16 tensor), else
    None: the caller then runs its torch path (GPU tensors, other dtypes, no compiler)."""
    module = ready()
    if module is None or t.device.type != "cpu" or str(t.dtype) not in _DTYPES:
        return None
    return module


def describe() -> dict:
    """What the kernels run as here: the loaded level (None if not loaded or unavailable), the
    best level this CPU can run, the CPU's model name and its relevant flags. Never builds."""
    module = ready()
    level = module.isa if module is not None else None
    comp = build._compilers.get(envs.cxx())
    return {
        "isa": level,
        "isa_cpu_best": isa.best().name,
        "isa_flags": list(isa.level(level).cxx_flags) if level in isa.BY_NAME else None,
        "kernels": "loaded" if module is not None else ("unavailable" if _tried else "not loaded"),
        "cpu_model": isa.cpu_model(),
        "cpu_flags": isa.relevant_flags(),
        "compiler": comp.description if comp is not None else None,
    }


def _build_all(cache_dir: str) -> int:
    comp = build.compiler()
    if comp is None:
        print(f"no C++ compiler ({envs.cxx()}): nothing built", file=sys.stderr)
        return 1
    status = 0
    for lvl in isa.LEVELS:
        if build.cached(cache_dir, lvl, comp):
            print(f"{lvl.name}: cached")
            continue
        rejected = build.supports(comp, lvl)
        if rejected is not None:
            print(f"{lvl.name}: skipped, {comp.description} does not support {' '.join(lvl.cxx_flags)}")
            continue
        try:
            print(f"{lvl.name}: built {build.build(cache_dir, lvl, comp)}")
        except build.BuildError as e:
            print(f"{lvl.name}: FAILED {e}", file=sys.stderr)
            status = 1
    return status


def main(argv=None) -> int:
    """`python -m pagedllm.kernels.cpu [--all-isas | --isa LEVEL]`: prebuild (make does this)."""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.kernels.cpu", description=main.__doc__)
    parser.add_argument("--all-isas", action="store_true", help="build every level the compiler supports")
    parser.add_argument("--isa", choices=isa.NAMES, help="build and load this level (refused if the CPU lacks it)")
    parser.add_argument("--cache-dir", default=None, help="default: $PAGEDLLM_CACHE_DIR/kernels or ~/.cache/pagedllm")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not envs.cpu_kernels_enabled():
        print("pagedllm CPU kernels: disabled (PAGEDLLM_DISABLE_CPU_KERNELS=1)")
        return 0
    cache_dir = args.cache_dir or envs.kernel_cache_dir()
    status = _build_all(cache_dir) if args.all_isas else 0
    try:
        module = select_and_load(cache_dir, args.isa, retry_failed=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    global _module, _tried
    _module, _tried = module, True
    info = describe()
    state = f"ready ({info['isa']})" if module is not None else "unavailable (pure-torch fallback)"
    print(f"pagedllm CPU kernels: {state}; CPU: {info['cpu_model']}, flags {' '.join(info['cpu_flags'])}")
    if args.isa and module is None:
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
