"""The C++ kernels built for one ISA level, for tests that run every level this CPU can."""
from __future__ import annotations

import pytest


def kernels_at_level(level: str):
    """The kernels built for one ISA level; the test skips where this CPU lacks the level's flags
    or where they cannot be built."""
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.kernels import isa

    lacking = isa.missing(isa.level(level))
    if lacking:
        pytest.skip(f"the {level} kernels need CPU flags this CPU lacks: {', '.join(lacking)}")
    module = cpu_kernels.select_and_load(level=level)
    if module is None:
        pytest.skip(f"the {level} kernels could not be built (no C++ compiler?)")
    return module
