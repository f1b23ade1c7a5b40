"""Quantized weights and the methods that load and multiply them (GPTQ, AWQ, compressed-tensors,
FP8, on-the-fly INT8). Linear layers ask their method; model files do not change."""
