"""Fixtures of the layer tests."""
import pytest

from pagedllm.kernels import cpu as cpu_kernels


@pytest.fixture(scope="session")
def kernels():
    """The built C++ CPU kernels module (tests that need it skip where no compiler is)."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ compiler: kernels unavailable")
    return module
