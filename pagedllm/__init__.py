"""pagedllm: a paged-KV-cache, continuously batched LLM inference engine.

Heavy modules (torch, transformers) load lazily so ``pagedllm serve`` starts fast.
"""
from __future__ import annotations

from pagedllm.version import __version__  # noqa: F401  (the package version)
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           # vLLM's public names (vllm/__init__.py) that pagedllm implements, under the same paths
           "AsyncLLMEngine", "LLMEngine", "BeamSearchParams", "TextPrompt", "TokensPrompt", "PromptType"]


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
        from pagedllm.outputs import CompletionOutput, RequestOutput

        return RequestOutput if name == "RequestOutput" else CompletionOutput
    if name == "AsyncLLMEngine":  # vLLM v1's name for its AsyncLLM
        return __getattr__("AsyncLLM")
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "BeamSearchParams":
        from pagedllm.sampling_params import BeamSearchParams

        return BeamSearchParams
    if name in ("TextPrompt", "TokensPrompt", "PromptType"):
        from pagedllm.inputs import PromptType, TextPrompt, TokensPrompt

        return {"TextPrompt": TextPrompt, "TokensPrompt": TokensPrompt, "PromptType": PromptType}[name]
    if name == "EngineConfig":
        from pagedllm.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
