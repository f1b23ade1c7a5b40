import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One GEMM form everywhere in the suite (inherited by worker processes and servers): with the
# default "auto" two engines compared token for token (PP=2 vs PP=1, mp vs in-process) could time
# a shape differently on a busy CI machine and round differently. tests/layers/test_gemm_select.py
# covers "auto" and "onednn".
os.environ.setdefault("PAGEDLLM_CPU_GEMM", "pagedllm")
# Without a GPU every Triton kernel under test runs in Triton's interpreter. Set before anything
# imports triton: a module imported in compiled mode by one test file and called in interpreted
# mode by another fails ("Cannot call @triton.jit'd outside of the scope of a kernel"), so the
# Triton files passed in the whole suite's order but not in every subset's.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import make_checkpoint  # noqa: E402
from prompts import random_prompts  # noqa: E402,F401  (re-exported for older imports)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "models", "tiny-shakespeare")


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.fixture(scope="session")
def make_ckpt(ckpt_dir):
    def _make(name: str, arch: str = "llama", **kw):
        return make_checkpoint(str(ckpt_dir / name), arch, **kw)

    return _make


@pytest.fixture(scope="session")
def default_model():
    if not os.path.exists(os.path.join(DEFAULT_MODEL, "model.safetensors")):
        pytest.skip("embedded default model not trained yet")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def kernels():
    """The built C++ CPU kernels module (tests that need it skip where no compiler is)."""
    from pagedllm.kernels import cpu as cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ compiler: kernels unavailable")
    return module

