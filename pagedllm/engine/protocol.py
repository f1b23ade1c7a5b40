"""EngineClient: what the HTTP layer (entrypoints/openai/) may use of an engine. AsyncLLM is one;
the server never reaches past it into the front end's or the core's internals."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Protocol, runtime_checkable

from pagedllm.outputs import RequestOutput


@runtime_checkable
class EngineClient(Protocol):
    config: Any  # the EngineConfig
    tokenizer: Any  # None with skip_tokenizer_init
    max_model_len: int
    input_processor: Any  # engine/input_processor.InputProcessor (prompt checks, max_prompt_chars, vocab_size)
    lora_registry: Any  # lora/registry.LoRARegistry, or None without enable_lora
    default_sampling_params: dict  # the model's generation_config.json recommendations
    stats: Any  # the last SchedulerStats
    dead_error: Optional[BaseException]
    on_step: Optional[Callable]
    on_finished: Optional[Callable]
    on_step_phases: Optional[Callable]

    @property
    def is_running(self) -> bool: ...

    def generate(self, prompt, params, request_id: Optional[str] = None,
                 lora_request=None, deadline: Optional[float] = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def check_structured_outputs(self, params) -> None: ...

    def compile_structured_outputs(self, params) -> Any: ...  # a concurrent Future, or None

    def core_snapshot(self) -> dict: ...

    def num_unfinished(self) -> int: ...

    def shutdown(self) -> None: ...
