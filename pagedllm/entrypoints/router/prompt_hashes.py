"""The block hash chain of a request's prompt, as the engines compute it: the served model's
tokenizer and chat template (pagedllm/tokenizer), then core/block_hash.extend_block_hashes with
the same block size and first-block key.

Keys: a request for the base model has none (as the engine's Request.cache_key without a cache
salt or adapter); a request naming another model (a LoRA adapter served by name) is keyed by that
name, so two adapters never share index entries. The engine's own key for an adapter also hashes
its files, which the router cannot read; the index only has to agree with itself.

A request the router cannot tokenise (bad fields, or text without a tokenizer: the replicas run
with --skip-tokenizer-init) gets no hashes: it is routed by load and the
replica answers it with its own 400.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from pagedllm.core.block_hash import extend_block_hashes

logger = logging.getLogger(__name__)


class PromptHasher:
    def __init__(self, tokenizer, block_size: int, base_model_names: set[str], chat_template: Optional[str] = None,
                 max_blocks: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.base_model_names = base_model_names
        self.chat_template = chat_template
        self.max_blocks = max_blocks  # the longest prefix considered (and the text tokenised for it)
        self._max_chars = max_blocks * block_size * 32  # tokens are rarely longer than 32 characters

    def token_ids(self, path: str, body: dict[str, Any]) -> Optional[list[int]]:
        """The prompt's token ids, or None (not tokenisable here: no tokenizer for text, bad fields)."""
        if path.endswith("/chat/completions"):
            if self.tokenizer is None:
                return None
            return self._chat_ids(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes to one replica, chosen for its first prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return None
            return list(self.tokenizer.encode(prompt[: self._max_chars]))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return None

    def _chat_ids(self, body: dict[str, Any]) -> Optional[list[int]]:
        from pagedllm.tokenizer.tokenizer import apply_chat_template

        messages = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            d = {"role": m.get("role"), "content": (content or "")[: self._max_chars]}
            if m.get("name"):
                d["name"] = m["name"]
            messages.append(d)
        if body.get("chat_template") is not None:
            return None  # a request's own template renders in the replica's sandbox only
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        return apply_chat_template(self.tokenizer, messages, body.get("add_generation_prompt", True),
                                   self.chat_template, **kwargs)

    def cache_key(self, body: dict[str, Any]) -> Optional[str]:
        model = body.get("model")
        if not model or model in self.base_model_names:
            return None
        return f"model:{model}"

    def block_hashes(self, path: str, body: dict[str, Any]) -> list[bytes]:
        """The prompt's full-block hashes (empty when it cannot be tokenised here)."""
        try:
            ids = self.token_ids(path, body)
        except Exception as e:  # the replica will refuse it with a proper 400
            logger.debug("router could not tokenise a request: %s", e)
            return []
        if not ids:
            return []
        hashes: list[bytes] = []
        extend_block_hashes(hashes, ids[: self.max_blocks * self.block_size], self.block_size, self.cache_key(body))
        return hashes
