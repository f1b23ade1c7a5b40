"""vLLM's public import paths, under pagedllm: every name of vllm/__init__.py that pagedllm
implements, and the module paths vLLM's examples import from."""
import importlib

import pytest

PATHS = [
    ("pagedllm", "LLM"), ("pagedllm", "SamplingParams"), ("pagedllm", "RequestOutput"), ("pagedllm", "CompletionOutput"),
    ("pagedllm", "AsyncLLMEngine"), ("pagedllm", "LLMEngine"), ("pagedllm", "BeamSearchParams"),
    ("pagedllm", "TextPrompt"), ("pagedllm", "TokensPrompt"), ("pagedllm", "PromptType"),
    ("pagedllm.sampling_params", "SamplingParams"), ("pagedllm.sampling_params", "BeamSearchParams"),
    ("pagedllm.sampling_params", "StructuredOutputsParams"), ("pagedllm.outputs", "RequestOutput"),
    ("pagedllm.outputs", "CompletionOutput"), ("pagedllm.inputs", "TextPrompt"), ("pagedllm.inputs", "TokensPrompt"),
    ("pagedllm.lora.request", "LoRARequest"), ("pagedllm.entrypoints.llm", "LLM"),
    ("pagedllm.engine.async_llm", "AsyncLLM"), ("pagedllm.engine.llm_engine", "LLMEngine"),
]


@pytest.mark.parametrize("module, name", PATHS)
def test_importable(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_one_class_behind_each_path():
    import pagedllm
    from pagedllm.engine.beam_search import BeamSearchParams as engine_beam
    from pagedllm.sampling_params import BeamSearchParams

    assert pagedllm.BeamSearchParams is BeamSearchParams is engine_beam
    assert pagedllm.AsyncLLMEngine is pagedllm.AsyncLLM
    assert BeamSearchParams(beam_width=2, max_tokens=4).n == 2
