"""How the Triton test files pick compiled kernels or Triton's interpreter (their shared preamble).

Compiled on CUDA machines (``PAGEDLLM_TRITON_NATIVE=1``, or simply CUDA present), the interpreter
on CPU (or with ``PAGEDLLM_TRITON_NATIVE=0``). Interpreter mode is process-wide in practice:
@triton.jit picks interpreter vs compiler when a kernel is *decorated*, which includes
triton.language's own helpers decorated when triton is first imported; so a file sets
``TRITON_INTERPRET`` before importing triton and its kernel modules, restores it afterwards, and
sets it again while its tests run (Triton imports some of its own @jit code lazily at launch).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

NATIVE = torch.cuda.is_available() and os.environ.get("PAGEDLLM_TRITON_NATIVE") != "0"


class InterpretEnv:
    """``TRITON_INTERPRET`` for this file's kernels, and the value it had before."""

    def __init__(self) -> None:
        self.prev = os.environ.get("TRITON_INTERPRET")
        self.triton_imported_before = "triton" in sys.modules

    def set(self) -> None:
        os.environ["TRITON_INTERPRET"] = "0" if NATIVE else "1"

    def restore(self) -> None:
        if self.prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self.prev


def enter() -> InterpretEnv:
    """Sets the mode and imports triton; skips the calling module when triton is not installed."""
    env = InterpretEnv()
    env.set()
    try:
        import triton  # noqa: F401
    except ImportError:
        env.restore()
        pytest.skip("triton is not installed", allow_module_level=True)
    return env


def skip_unless_interpreted(kernel, module_name: str, env: InterpretEnv) -> None:
    """Without CUDA the kernels must have been decorated under the interpreter; a module imported
    compiled earlier in this process cannot run here."""
    if not NATIVE and type(kernel).__name__ != "InterpretedFunction":
        env.restore()
        pytest.skip(f"{module_name} was imported with compiled kernels earlier in this process; run this file on "
                    "its own", allow_module_level=True)


def patch_interpreter() -> None:
    """Works around two Triton 3.6 interpreter bugs (no effect on compiled kernels), once per process.

    * Scalars are 1-element arrays and ``__index__`` does ``int(arr)``, which NumPy >= 2.4
      rejects, so ``for t in range(tensor_lo, tensor_hi)`` fails.
    * ``tl.dot`` on bf16 runs ``np.matmul`` on the raw uint16 storage; upcast to fp32 first
      (the compiled kernel also accumulates bf16 products in fp32).
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover
        return
    if getattr(interp, "_pagedllm_patched", False):
        return
    orig_patch_tensor = getattr(interp, "_patch_lang_tensor", None)
    if orig_patch_tensor is not None:

        def _patch_lang_tensor(tensor, scope):
            orig_patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interp._patch_lang_tensor = _patch_lang_tensor
    builder = getattr(interp, "InterpreterBuilder", None)
    if builder is not None and hasattr(builder, "create_dot"):
        orig_dot = builder.create_dot

        def _up(h):
            if h.dtype == tl.bfloat16:
                return interp.TensorHandle((h.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return orig_dot(self, _up(a), _up(b), d, input_precision, max_num_imprecise_acc)

        builder.create_dot = create_dot
    interp._pagedllm_patched = True
