"""Optional C++ CPU kernels (csrc/), built on first use with the system compiler and cached on disk.

The build is ours (not torch's ``cpp_extension.load``), because that one serialises builders
with a lock file that a killed process leaves behind, hanging every later process. Here each
builder compiles into its own temporary file and atomically renames it into a cache directory
keyed by (source, flags, torch, python); concurrent builders just race harmlessly.

If no compiler is available, ``load()`` returns None and every caller keeps its pure-torch path
(``for_tensor`` is how layers ask); both paths are tested against each other.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from typing import Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

_NAME = "pagedllm_cpu_kernels"
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_MAIN = os.path.join(_CSRC, "module.cpp")  # the one translation unit; it includes the headers
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]

_lock = threading.Lock()
_module = None
_tried = False


def _build(torch, cache_dir: str) -> str:
    src = b""
    for name in sorted(os.listdir(_CSRC)):  # every header is part of the cache key
        with open(os.path.join(_CSRC, name), "rb") as f:
            src += name.encode() + f.read()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(src + repr((_FLAGS, torch.__version__, sys.version, abi)).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir, key)
    target = os.path.join(out_dir, _NAME + ".so")
    if os.path.exists(target):
        return target
    # Imported only to build: it pulls in setuptools, whose import hooks racing with imports on
    # other threads made a module import fail once (the cached path must stay import-free).
    from torch.utils import cpp_extension

    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [os.environ.get("CXX", "c++"), *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={_NAME}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [_MAIN, "-o", tmp]
    for lib_dir in cpp_extension.library_paths():
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        os.replace(tmp, target)  # atomic: a concurrent builder either sees nothing or a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(cache_dir: Optional[str] = None):
    """Build (once per machine, cached under ``cache_dir``: EngineConfig.kernel_cache_dir) and
    import the kernels; None when that is impossible."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            import torch

            path = _build(torch, cache_dir or envs.kernel_cache_dir())
            loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
            spec = importlib.util.spec_from_loader(_NAME, loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            _module = module
        except Exception as e:  # no compiler, failed build: fall back to the torch path
            detail = getattr(e, "stderr", "") or ""
            logger.warning("CPU kernels unavailable (%s %s); using the pure-torch path", e, detail[-500:])
            _module = None
        finally:
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


if __name__ == "__main__":  # `python -m pagedllm.kernels.cpu`: prebuild (make does this)
    logging.basicConfig(level=logging.INFO)
    ok = envs.cpu_kernels_enabled() and load() is not None
    print("pagedllm CPU kernels:", "ready" if ok else "unavailable (pure-torch fallback)")
