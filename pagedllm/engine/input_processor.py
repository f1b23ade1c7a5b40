"""InputProcessor: a request (prompt + params + adapter) -> one validated EngineCoreRequest.

Everything a request is checked for happens here, once, in the front end: the prompt (text,
token ids, or {"prompt_token_ids": ...}) tokenised and its ids checked; the fan-out (n, best_of,
beam_width) against max_n and the cache; the adapter resolved; the engine features it needs
(pipeline parallelism, speculative decoding) checked for compatibility; the token cap clipped
to max_model_len and the model's EOS folded into the stop tokens. The core trusts what it gets.

``process(prompt)`` returns a ``ProcessedPrompt``; passing that back in is free, so a caller
that tokenised already (the server, to count tokens) never pays twice.

A text prompt longer than ``max_prompt_chars`` (max_model_len tokens of the longest token, with
a margin of 2) can never fit and is refused before it is tokenised: tokenising megabytes takes
seconds."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedllm.config import hf_field
from pagedllm.core.engine_request import BeamSpec, EngineCoreRequest, EngineLimits
from pagedllm.core.grammar_wait import no_tokenizer_for_structured_outputs
from pagedllm.engine.best_of import child_params, uses_best_of
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer.tokenizer import max_token_chars


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt already validated by an InputProcessor (its text when it had one; a prompt dict's
    ``cache_salt`` and ``priority``)."""

    text: Optional[str]
    token_ids: list[int]
    cache_salt: Optional[str] = None
    priority: int = 0
    mm_features: tuple = ()  # its images (contracts.MultiModalFeature): placeholders expanded in token_ids

    def __iter__(self):  # (text, ids) unpacking, as process() returned before
        return iter((self.text, self.token_ids))


PromptType = Union[str, list[int], dict[str, Any], ProcessedPrompt]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, limits: Optional[EngineLimits] = None,
                 eos_token_ids: Optional[list[int]] = None, lora_registry=None, structured=None,
                 images=None, media=None,
                 logits_processors=()) -> None:
        """``images``: the model's multimodal.processor.ImagePromptProcessor (None: a text model);
        ``media``: a multimodal.media.MediaSources, where images named by a path or URL may come from
        (None: only data: URLs)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits
        self.eos_token_ids = list(eos_token_ids or [])
        self.lora_registry = lora_registry  # LoRARegistry (enable_lora) or None
        self.structured = structured  # StructuredOutputManager (has a tokenizer) or None
        self.images = images
        self.media = media
        self.logits_processors = list(logits_processors)  # --logits-processors' classes (their validate_params)
        self.max_prompt_chars = 2 * max_model_len * max_token_chars(tokenizer) if tokenizer is not None else 0

    # ---- prompts ----------------------------------------------------------------------------
    def check_text_length(self, text: str) -> None:
        if self.max_prompt_chars and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters, more than the {self.max_prompt_chars} that max_model_len "
                f"({self.max_model_len} tokens) could ever hold"
            )

    def process(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None) -> ProcessedPrompt:
        """The prompt's text and token ids (and its dict's cache_salt and priority);
        ``truncate_prompt_tokens``: keep the last N ids (-1: max_model_len - 1). A ProcessedPrompt
        is returned as it is (it was checked, and truncated, when it was made)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        text: Optional[str] = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError("prompt must be a string")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead")
            if truncate_prompt_tokens is None:
                self.check_text_length(text)
            ids = self.tokenizer.encode(text)
        ids = list(ids)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        features: tuple = ()
        if mm_data is not None or (self.images is not None and self.images.image_token_id in ids):
            if truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens cannot be combined with images (it would cut through "
                                 "their placeholders)")
            ids, features = self._expand_images(ids, mm_data)
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            ids = ids[-keep:]
        if not ids:
            raise ValueError("prompt must not be empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but max_model_len is {self.max_model_len}: there is no room to generate"
            )
        if isinstance(prompt, dict):  # vLLM's prompt fields; the server's request priority
            return ProcessedPrompt(text, ids, prompt.get("cache_salt"), prompt.get("priority", 0), features)
        return ProcessedPrompt(text, ids)

    def _expand_images(self, ids: list[int], mm_data) -> tuple[list[int], tuple]:
        """The ids with each image placeholder expanded, and the images' features."""
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes no images")
        images = self.images.images_of(mm_data) if mm_data is not None else []
        return self.images.process(ids, images, self.media)

    # ---- adapters and constraints -----------------------------------------------------------
    def resolve_lora(self, lora_request):
        """The adapter handle of a LoRARequest (checked on first sight; ValueError if it is bad or
        the engine runs without enable_lora); None for the base model."""
        if lora_request is None:
            return None
        if self.lora_registry is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        return self.lora_registry.resolve(lora_request)

    def check_structured_outputs(self, params) -> None:
        """Compile ``params.structured_outputs`` now: ValueError naming the field when it does not
        compile or xgrammar is missing (CompileTimeoutError past structured_compile_timeout)."""
        spec = self._structured_spec(params)
        if spec is not None:
            self.structured.validate(spec)

    def compile_structured_outputs(self, params):
        """Start compiling ``params.structured_outputs`` on the compile pool: the caller's Future
        (cancel it to withdraw), or None when there is no constraint. ValueError at once for a bad
        or over-limit constraint, CompilePoolFullError when the pool is full."""
        spec = self._structured_spec(params)
        return self.structured.submit(spec) if spec is not None else None

    def _structured_spec(self, params):
        spec = params.structured_outputs  # BeamSearchParams has the property too (always None)
        if spec is None:
            return None
        if self.structured is None:
            raise no_tokenizer_for_structured_outputs()
        if self.limits is not None and self.limits.speculative:  # the mask covers one token a step
            raise ValueError("structured_outputs cannot be combined with speculative decoding on this engine yet")
        return spec

    # ---- whole requests ---------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                     arrival_time: Optional[float] = None, lora_request=None) -> tuple[ProcessedPrompt, EngineCoreRequest]:
        """The EngineCoreRequest of a SamplingParams request (ValueError naming the field)."""
        limits = self._limits()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n > limits.max_n:
            raise ValueError(f"n must be at most {limits.max_n} (max_n), got {params.n}")
        if params.best_of is not None and params.best_of > limits.max_n:
            raise ValueError(f"best_of must be at most {limits.max_n} (max_n), got {params.best_of}")
        self._structured_spec(params)
        for cls in self.logits_processors:
            cls.validate_params(params)  # a ValueError: this request's 400
        prompt = self.process(prompt, params.truncate_prompt_tokens)
        if prompt.mm_features:
            self._check_images_supported(limits)
        lora = self.resolve_lora(lora_request)
        max_tokens = self.max_model_len - len(prompt.token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        params = params.clone().with_eos(self.eos_token_ids)
        if params.bad_words:
            params.with_bad_words(self.tokenizer)
        if uses_best_of(params):  # best_of children sampled; the n best returned when all are done
            params = child_params(params).clone(n=params.best_of)
        num_children = params.n
        return prompt, EngineCoreRequest(request_id, prompt.token_ids, params, max_tokens, _now(arrival_time),
                                         num_children=num_children, lora=lora, cache_salt=prompt.cache_salt,
                                         priority=prompt.priority, mm_features=prompt.mm_features)

    def make_beam_request(self, request_id: str, prompt: PromptType, params,
                          arrival_time: Optional[float] = None, lora_request=None
                          ) -> tuple[ProcessedPrompt, EngineCoreRequest]:
        """The EngineCoreRequest of a BeamSearchParams request: one beam group."""
        limits = self._limits()
        if params.beam_width > limits.max_n:
            raise ValueError(f"beam_width must be at most {limits.max_n} (max_n), got {params.beam_width}")
        if lora_request is not None:
            raise ValueError("beam search with a LoRA adapter (lora_request) is not supported")
        if limits.pipeline_parallel:
            raise ValueError("beam search does not support pipeline_parallel_size > 1 yet")
        if params.beam_width > min(limits.max_num_seqs, limits.max_num_batched_tokens):
            raise ValueError(f"beam_width must be at most max_num_seqs and max_num_batched_tokens (the beams run "
                             f"as sequences of one step), got {params.beam_width}")
        prompt = self.process(prompt)
        if prompt.mm_features:
            raise ValueError("beam search with images (multi_modal_data) is not supported yet")
        ids = prompt.token_ids
        max_tokens = min(self.max_model_len - len(ids), params.max_tokens)
        need = params.beam_width * -(-(len(ids) + max_tokens) // limits.block_size)
        if need > limits.num_blocks:  # W beams recomputed apart after a preemption must fit
            raise ValueError(f"beam_width x (prompt + max_tokens) needs up to {need} KV blocks, the cache has "
                             f"{limits.num_blocks}: lower beam_width or max_tokens")
        sp = params.to_sampling_params().with_eos(self.eos_token_ids)
        beam = BeamSpec(params.beam_width, params.length_penalty, params.early_stopping)
        return prompt, EngineCoreRequest(request_id, ids, sp, max_tokens, _now(arrival_time), beam=beam,
                                         cache_salt=prompt.cache_salt, priority=prompt.priority)

    @staticmethod
    def _check_images_supported(limits: EngineLimits) -> None:
        if limits.speculative:
            raise ValueError("multi_modal_data cannot be combined with speculative decoding on this engine yet")

    def _limits(self) -> EngineLimits:
        if self.limits is None:
            raise ValueError("this InputProcessor checks prompts only (it was made without the engine's limits)")
        return self.limits


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> list[int]:
    """The model's EOS token ids (generation_config.json, else config.json, else the tokenizer's)."""
    ids: list[int] = []
    try:  # generation_config.json read directly: importing transformers costs seconds
        import json
        import os

        with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            ids = [eos] if isinstance(eos, int) else list(eos)
    except Exception:
        pass
    if not ids:
        e = hf_field(hf_config, "eos_token_id")
        if e is None and tokenizer is not None:
            e = tokenizer.eos_token_id
        if e is not None:
            ids = [e] if isinstance(e, int) else list(e)
    return ids


def _now(arrival_time: Optional[float]) -> float:
    return time.monotonic() if arrival_time is None else arrival_time
