"""The Triton LoRA kernels (segmented shrink + expand, lora/triton_ops.py) inside LoRALinear vs
the delta written out in torch: mixed slots with base rows between them, a slot whose adapter
skips the layer, one slot covering every row, column- and row-parallel layers. Without CUDA they
run under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors, float32)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

NATIVE = torch.cuda.is_available() and os.environ.get("PAGEDLLM_TRITON_NATIVE") != "0"
_already = "triton" in sys.modules
_prev = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "0" if NATIVE else "1"


def _restore() -> None:
    if _prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _prev


try:
    import triton  # noqa: F401
    import triton.language.standard as _tl_std

    import pagedllm.lora.triton_ops  # noqa: F401  (kernels decorated while the interpreter is on)
except ImportError:
    _restore()
    pytest.skip("triton is not installed", allow_module_level=True)
if not NATIVE and _already and type(_tl_std.cdiv).__name__ != "InterpretedFunction":
    _restore()
    pytest.skip("triton was imported compiled earlier in this process; run this file on its own",
                allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    yield  # the interpreter reads TRITON_INTERPRET at launch too: on for this module's tests only
    _restore()

from pagedllm.distributed.parallel_state import get_tp_group  # noqa: E402
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from pagedllm.lora.batch import LoRAStepState, build_lora_batch  # noqa: E402
from pagedllm.lora.layers import LoRALinear  # noqa: E402

DEV = torch.device("cuda" if NATIVE else "cpu")
SLOTS, MAX_RANK, K = 3, 8, 40


def make(row: bool):
    torch.manual_seed(0)
    out_sizes = [24] if row else [48, 20]
    with torch.device(DEV):
        base = RowParallelLinear(K, 24) if row else ColumnParallelLinear(K, out_sizes)
    base.weight.data.normal_(0, 0.1)
    state = LoRAStepState()
    targets = ("o",) if row else ("gate", "up")
    layer = LoRALinear(base, targets, out_sizes, K, row, state, SLOTS, MAX_RANK, get_tp_group(), torch.float32, DEV)
    layer.use_triton = True
    pieces = {}
    for slot, (rank, present) in enumerate([(8, (0, 1)), (5, (1,)), (3, ())] if not row else
                                           [(8, (0,)), (5, (0,)), (3, ())]):
        p = {t: (torch.randn(rank, K, device=DEV), torch.randn(out_sizes[t], rank, device=DEV)) for t in present}
        layer.set_slot(slot, rank, p)
        pieces[slot] = p
    return layer, state, base, out_sizes, pieces


def reference(x, base, out_sizes, pieces, token_slots):
    y = base(x).clone()
    offsets = np.cumsum([0] + out_sizes)
    for i, s in enumerate(token_slots.tolist()):
        for t, (a, b) in pieces.get(s, {}).items() if s >= 0 else ():
            y[i, offsets[t]:offsets[t + 1]] += b @ (a @ x[i])
    return y


@pytest.mark.parametrize("row", [False, True])
@pytest.mark.parametrize("case", ["mixed", "one_slot_all_rows"])
def test_triton_delta_matches_torch(row, case):
    layer, state, base, out_sizes, pieces = make(row)
    T = 37
    rng = np.random.default_rng(1)
    slots = rng.integers(-1, SLOTS, T) if case == "mixed" else np.zeros(T, dtype=np.int64)
    x = torch.randn(T, K, device=DEV)
    state.batch = build_lora_batch(slots, DEV, with_segments=True)
    got = layer(x)
    torch.testing.assert_close(got, reference(x, base, out_sizes, pieces, slots), rtol=1e-4, atol=1e-4)
    state.batch = None
    torch.testing.assert_close(layer(x), base(x))  # no adapter rows: the base alone
