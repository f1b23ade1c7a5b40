"""Incremental detokenizer: token ids in, text deltas out.

Decodes a short window of tokens (``prefix_offset:``) and emits only the text after the part
already emitted (``prefix_offset:read_offset``). Text ending in U+FFFD is held back: it is an
incomplete multi-byte UTF-8 character whose remaining bytes come with the next tokens. Starting
the window a few tokens into the prompt keeps sentencepiece's leading-space rules right.
"""
from __future__ import annotations

_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "skip_special_tokens", "special_ids")

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        window = [t for t in prompt_ids if t not in self.special_ids][-_INITIAL_WINDOW:]
        self.ids: list[int] = list(window)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_ids: list[int]) -> str:
        if self.skip_special_tokens:
            new_ids = [t for t in new_ids if t not in self.special_ids]
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # keep the window short
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (even a lone U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
