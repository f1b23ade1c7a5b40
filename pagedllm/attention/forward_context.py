"""Per-step side channel: the attention metadata every attention layer reads during one forward.

Set once by the model runner around the forward call, so model code keeps the signature
``forward(input_ids, positions)``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from pagedllm.attention.backend import AttentionMetadata

_current: Optional[AttentionMetadata] = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata is only available inside a model runner forward")
    return _current


@contextmanager
def set_attention_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    prev, _current = _current, metadata
    try:
        yield
    finally:
        _current = prev
