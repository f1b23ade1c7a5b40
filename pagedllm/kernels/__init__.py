"""Compiled kernels: ``cpu`` builds and loads the C++ CPU ops in ``csrc/`` (Triton GPU kernels live
with their attention backend)."""
