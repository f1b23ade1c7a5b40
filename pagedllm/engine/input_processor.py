"""InputProcessor: prompt (text, token ids, or {"prompt_token_ids": ...}) -> validated token ids.

A text prompt longer than ``max_prompt_chars`` (max_model_len tokens of the longest token, with
a margin of 2) can never fit and is refused before it is tokenised: tokenising megabytes takes
seconds."""
from __future__ import annotations

from typing import Any, Optional, Union

from pagedllm.tokenizer.tokenizer import max_token_chars

PromptType = Union[str, list[int], dict[str, Any]]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = 2 * max_model_len * max_token_chars(tokenizer) if tokenizer is not None else 0

    def check_text_length(self, text: str) -> None:
        if self.max_prompt_chars and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters, more than the {self.max_prompt_chars} that max_model_len "
                f"({self.max_model_len} tokens) could ever hold"
            )

    def process(self, prompt: PromptType, truncate_prompt_tokens: Optional[int] = None) -> tuple[Optional[str], list[int]]:
        """(text, token ids); ``truncate_prompt_tokens``: keep the last N ids (-1: max_model_len - 1)."""
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
        return text, ids
