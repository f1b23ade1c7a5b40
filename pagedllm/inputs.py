"""vLLM's prompt types (``from vllm.inputs import TextPrompt, TokensPrompt``): what ``LLM.generate``
and the engines take as one prompt besides a plain string or a list of token ids."""
from __future__ import annotations

from typing import TypedDict, Union

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # keys the prompt's first KV block: tenants never share cached blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
