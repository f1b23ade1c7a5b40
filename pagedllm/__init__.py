"""pagedllm: a paged-KV-cache, continuously batched LLM inference engine.

Heavy modules (torch, transformers) load lazily so ``pagedllm serve`` starts fast.
"""
from __future__ import annotations

from pagedllm.version import __version__  # noqa: F401  (the package version)
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]


def __getattr__(name: str):
    if name in ("LLM", "AsyncLLM"):  # OpenMP's wait policy, before torch loads (worker/cpu_threads.py)
        from pagedllm.worker.cpu_threads import apply_omp_environment

        apply_omp_environment()
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from pagedllm.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name == "SamplingParams":
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedllm import outputs

        return getattr(outputs, name)
    if name == "EngineConfig":
        from pagedllm.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
