"""Compiled kernels: ``cpu`` loads the C++ CPU ops in ``csrc/``, built (``build``) for the highest
instruction-set level this CPU runs (``isa``) and cached on disk (Triton GPU kernels live with
their attention backend)."""
