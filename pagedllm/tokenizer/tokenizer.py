"""Tokenizer loading (HF, local files only) and chat-template rendering."""
from __future__ import annotations

from typing import Any, Optional


def load_tokenizer(path: str):
    from pagedllm.tokenizer.light_tokenizer import load_light_tokenizer

    light = load_light_tokenizer(path)  # plain tokenizer.json: no transformers import (seconds)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # surface a clear message; no network fallback
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: Optional[str] = None, **kwargs) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template explicitly")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
