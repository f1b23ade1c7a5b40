"""Compiling the CPU kernels for one ISA level, and the on-disk cache of builds and failures.

A build is ``<cache_dir>/<level>-<key>/<compiler>.so``: ``key`` hashes the level's compiler
flags, every file in ``csrc/``, torch's version and C++ ABI and Python's version; ``compiler``
hashes the compiler's resolved path and ``--version`` output. A process without a compiler can
still load a build made for its level and sources by any compiler (a container image). A failed
build leaves ``<compiler>.failed`` (the reason and the compiler's error tail) beside it: later
processes skip that key with one warning, until the sources or the compiler change, or until
``python -m pagedllm.kernels.cpu`` retries it.

The build is ours, not torch's ``cpp_extension.load``, whose lock file, left behind by a killed
process, hangs every later one. Builders of one key take turns on an ``flock`` of
``<compiler>.lock`` (the kernel drops it when its holder dies, so a killed builder never blocks
the next): a process that waited for another's build loads that build instead of compiling the
same sources again. Each builder still compiles in its own temporary directory and atomically
renames the result into place, so a builder that gives up waiting races harmlessly. Translation
units (``csrc/*.cpp``: one per kernel family, plus the pybind module) compile in parallel, one
per core, and are linked into one extension module.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from pagedllm import envs
from pagedllm.kernels.isa import Level

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
COMMON_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-fvisibility=hidden")
LIBS = ("-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python")
_TIMEOUT_S = 900
_STALE_S = 3600  # a temporary build directory this old was left by a killed builder


class BuildError(RuntimeError):
    pass


def module_name(level: Level) -> str:
    return f"pagedllm_cpu_kernels_{level.name}"


@dataclass(frozen=True)
class Compiler:
    argv: tuple  # $CXX split into words (e.g. "ccache g++")
    path: str  # the resolved executable
    version: str  # its --version output

    @property
    def tag(self) -> str:
        return hashlib.sha256(f"{self.path}\0{self.version}".encode()).hexdigest()[:12]

    @property
    def description(self) -> str:
        first = self.version.splitlines()[0] if self.version else "?"
        return f"{' '.join(self.argv)} ({first})"


_compilers: Dict[str, Optional[Compiler]] = {}
_probes: Dict[tuple, Optional[str]] = {}


def compiler() -> Optional[Compiler]:
    """The C++ compiler ($CXX, else c++), or None where there is none."""
    cxx = envs.cxx()
    if cxx not in _compilers:
        argv = tuple(shlex.split(cxx))
        path = shutil.which(argv[0]) if argv else None
        found = None
        if path is not None:
            try:
                out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60)
                if out.returncode == 0:
                    found = Compiler(argv, os.path.realpath(path), (out.stdout or out.stderr).strip())
            except (OSError, subprocess.SubprocessError):
                pass
        _compilers[cxx] = found
    return _compilers[cxx]


def forget() -> None:
    """Forget the compiler and its probes (as a new process would)."""
    _compilers.clear()
    _probes.clear()


def sources() -> List[str]:
    return sorted(p for p in glob.glob(os.path.join(CSRC, "*")) if p.endswith((".h", ".hpp", ".cpp")))


def _torch_key():
    import torch

    return torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI)


def key_dir(cache_dir: str, level: Level) -> str:
    """The directory of ``level``'s builds of the current sources for this torch and Python."""
    digest = hashlib.sha256()
    for path in sources():
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    digest.update(repr((level.name, level.cxx_flags, COMMON_FLAGS, LIBS, _torch_key(), sys.version,
                        sysconfig.get_config_var("EXT_SUFFIX"))).encode())
    return os.path.join(cache_dir, f"{level.name}-{digest.hexdigest()[:16]}")


def cached(cache_dir: str, level: Level, comp: Optional[Compiler]) -> Optional[str]:
    """The cached build of ``level`` by ``comp`` (by any compiler when ``comp`` is None), or None."""
    d = key_dir(cache_dir, level)
    if comp is not None:
        path = os.path.join(d, comp.tag + ".so")
        return path if os.path.exists(path) else None
    builds = sorted(glob.glob(os.path.join(d, "*.so")), key=os.path.getmtime, reverse=True)
    return builds[0] if builds else None


def failure_path(cache_dir: str, level: Level, comp: Compiler) -> str:
    return os.path.join(key_dir(cache_dir, level), comp.tag + ".failed")


def failure(cache_dir: str, level: Level, comp: Compiler) -> Optional[str]:
    """The remembered failure of this build (its reason and error tail), or None."""
    try:
        with open(failure_path(cache_dir, level, comp)) as f:
            return f.read()
    except OSError:
        return None


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def supports(comp: Compiler, level: Level) -> Optional[str]:
    """None if ``comp`` compiles ``level``'s instructions, else the compiler's complaint."""
    if not level.cxx_flags:
        return None
    key = (comp.tag, level.name)
    if key not in _probes:
        with tempfile.TemporaryDirectory(prefix="pagedllm-probe-") as tmp:
            cmd = [*comp.argv, *level.cxx_flags, "-x", "c++", "-c", "-", "-o", os.path.join(tmp, "probe.o")]
            try:
                out = subprocess.run(cmd, input=f"#include <immintrin.h>\n{level.probe}\n", capture_output=True,
                                     text=True, timeout=120)
                _probes[key] = None if out.returncode == 0 else (out.stderr.strip() or f"exit {out.returncode}")
            except (OSError, subprocess.SubprocessError) as e:
                _probes[key] = str(e)
    return _probes[key]


def _run_parallel(cmds: Dict[str, List[str]], jobs: int) -> None:
    """Run the commands, ``jobs`` at a time; on the first failure stop the rest and raise."""
    pending = list(cmds.items())
    running: Dict[str, tuple] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                name, cmd = pending.pop(0)
                err = tempfile.TemporaryFile(mode="w+")
                running[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err), err, time.monotonic())
            for name, (proc, err, started) in list(running.items()):
                if proc.poll() is None:
                    if time.monotonic() - started > _TIMEOUT_S:
                        proc.kill()
                        proc.wait()
                        raise BuildError(f"{name}: compiler timed out after {_TIMEOUT_S} s")
                    continue
                del running[name]
                err.seek(0)
                text = err.read()
                err.close()
                if proc.returncode != 0:
                    raise BuildError(f"{name}: compiler exited {proc.returncode}\n{text}")
            if running:
                time.sleep(0.05)
    finally:
        for proc, err, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _clean_stale(d: str) -> None:
    for tmp in glob.glob(os.path.join(d, ".build-*")) + glob.glob(os.path.join(d, ".tmp-*")):
        try:
            if time.time() - os.path.getmtime(tmp) > _STALE_S:
                shutil.rmtree(tmp) if os.path.isdir(tmp) else os.unlink(tmp)
        except OSError:
            pass


@contextlib.contextmanager
def _turn(lock_path: str, timeout_s: float = _TIMEOUT_S):
    """Hold the builders' lock of one key; yields True if another builder held it first. After
    ``timeout_s`` of waiting, go ahead without it (the atomic rename keeps that safe)."""
    with open(lock_path, "a") as f:
        waited, deadline, held = False, time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        try:
            yield waited
        finally:
            if held:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build(cache_dir: str, level: Level, comp: Compiler, jobs: Optional[int] = None) -> str:
    """Compile and link ``level``'s kernels with ``comp`` into the cache; the path of the .so.
    A failure is remembered on disk (see the module docstring) and raised as BuildError. A
    build another process finished while this one waited for its turn is returned as it is."""
    d = key_dir(cache_dir, level)
    target = os.path.join(d, comp.tag + ".so")
    os.makedirs(d, exist_ok=True)
    with _turn(os.path.join(d, comp.tag + ".lock")) as waited:
        if waited:
            if os.path.exists(target):
                return target
            failed = failure(cache_dir, level, comp)
            if failed is not None:
                raise BuildError(failed.splitlines()[0])
        return _build_locked(cache_dir, level, comp, d, target, jobs)


def _build_locked(cache_dir: str, level: Level, comp: Compiler, d: str, target: str, jobs: Optional[int]) -> str:
    _clean_stale(d)
    rejected = supports(comp, level)
    if rejected is not None:
        reason = f"{comp.description} does not compile {level.name} ({' '.join(level.cxx_flags)})"
        _write_atomic(failure_path(cache_dir, level, comp), f"{reason}\n{rejected[-3000:]}\n")
        raise BuildError(reason)
    # Imported only to build: it pulls in setuptools, whose import hooks racing with imports on
    # other threads made a module import fail once (the cached path must stay import-free).
    from torch.utils import cpp_extension

    _, abi = _torch_key()
    tmp = tempfile.mkdtemp(prefix=".build-", dir=d)
    try:
        base = [*comp.argv, *COMMON_FLAGS, *level.cxx_flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                f"-DTORCH_EXTENSION_NAME={module_name(level)}", f'-DPAGEDLLM_ISA="{level.name}"',
                f"-I{CSRC}", f"-I{sysconfig.get_paths()['include']}"]
        base += [f"-I{p}" for p in cpp_extension.include_paths()]
        units = [p for p in sources() if p.endswith(".cpp")]
        objs = {os.path.basename(p): os.path.join(tmp, os.path.basename(p) + ".o") for p in units}
        cmds = {os.path.basename(p): [*base, "-c", p, "-o", objs[os.path.basename(p)]] for p in units}
        _run_parallel(cmds, jobs or _cores())
        so = os.path.join(tmp, "kernels.so")
        link = [*comp.argv, "-shared", "-fopenmp", *objs.values(), "-o", so]
        for lib_dir in cpp_extension.library_paths():
            link += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
        _run_parallel({"link": [*link, *LIBS]}, 1)
        os.replace(so, target)  # atomic: a concurrent builder either sees nothing or a whole file
    except (BuildError, OSError) as e:
        reason = f"building {level.name} with {comp.description} failed"
        _write_atomic(failure_path(cache_dir, level, comp), f"{reason}\n{str(e)[-3000:]}\n")
        raise BuildError(f"{reason}: {str(e)[-1500:]}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.unlink(failure_path(cache_dir, level, comp))  # a retry that succeeded
    except OSError:
        pass
    return target
