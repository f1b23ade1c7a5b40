"""The pooling engine (``runner="pooling"``): inputs tokenized and validated once, packed into
batches of at most ``max_num_batched_tokens`` tokens / ``max_num_seqs`` sequences, each batch ONE
forward of the pooling runner (worker/pooling_runner.py), results pooled per input.

Tasks, in vLLM's names: ``embed`` (one vector per input; Matryoshka ``dimensions`` where the
model supports it), ``token_embed`` (every token's vector), ``classify`` (a classifier's
scores), ``score`` (a cross-encoder's score of each (text_1, text_2) pair, or the cosine of two
embeddings for an embedding model). Thread-safe: one forward at a time.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence, Union

import torch

from pagedllm.config import EngineConfig, resolve_max_model_len, resolve_max_num_batched_tokens
from pagedllm.models.config_json import load_hf_config
from pagedllm.models.pooler_config import load_pooler_config
from pagedllm.worker.pooling_runner import PoolingRunner, classifier_scores, is_pooling_architecture, pool

Prompt = Union[str, Sequence[int]]
POOLING_TASKS = ("embed", "token_embed", "classify", "score")


def wants_pooling(config: EngineConfig, hf_config=None) -> bool:
    """runner "pooling", or "auto" with an encoder / classifier architecture."""
    if config.runner != "auto":
        return config.runner == "pooling"
    hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
    return any(is_pooling_architecture(a) for a in (getattr(hf_config, "architectures", None) or []))


class PoolingEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.hf_config = hf_config = load_hf_config(config.model)
        limit = resolve_max_model_len(hf_config, config.max_model_len)
        if getattr(hf_config, "model_type", "") in ("xlm-roberta", "roberta"):  # positions from pad_token_id + 1
            limit = min(limit, hf_config.max_position_embeddings - hf_config.pad_token_id - 1)
        self.max_model_len = limit
        self.max_num_batched_tokens = max(resolve_max_num_batched_tokens(config, limit), limit)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, local_files_only=True)
        except Exception as e:
            raise ValueError(f"could not load a tokenizer from {config.tokenizer or config.model!r}: {e}") from e
        self.runner = PoolingRunner(config, hf_config, limit, self.max_num_batched_tokens)
        self.pooler = load_pooler_config(config.model, hf_config, self.runner.is_encoder)
        self.is_cross_encoder = self.runner.is_classifier
        self.vocab_size = hf_config.vocab_size
        self._lock = threading.Lock()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("classify", "score") if self.is_cross_encoder else ("embed", "token_embed", "score")

    # ---- inputs -------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, field: str = "input") -> list[int]:
        """Token ids of a string (with the model's special tokens) or a checked list of ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{field}: token ids must be integers in [0, {self.vocab_size})")
        return self._check_length(ids, field)

    def tokenize_pair(self, a: str, b: str) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: both texts with the tokenizer's separators and segment ids."""
        enc = self.tokenizer(a, b, add_special_tokens=True, return_token_type_ids=True)
        ids = self._check_length(enc["input_ids"], "text")
        if (getattr(self.hf_config, "type_vocab_size", 2) or 1) < 2:  # XLM-RoBERTa: one segment embedding
            return ids, [0] * len(ids)
        return ids, list(enc["token_type_ids"])

    def _check_length(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise ValueError(f"{field}: an input must have at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{field}: an input of {len(ids)} tokens exceeds max_model_len ({self.max_model_len})")
        return ids

    # ---- batching -----------------------------------------------------------------------------
    def _forward(self, seqs: list[list[int]], types: Optional[list[list[int]]] = None):
        """Hidden states (and logits) of every sequence, in order, over as few forwards as the
        token and sequence budgets allow."""
        hidden, logits, start = [], [], 0
        with self._lock:
            while start < len(seqs):
                end, tokens = start, 0
                while end < len(seqs) and end - start < self.config.max_num_seqs and (
                        end == start or tokens + len(seqs[end]) <= self.max_num_batched_tokens):
                    tokens += len(seqs[end])
                    end += 1
                out = self.runner.run(seqs[start:end], types[start:end] if types is not None else None)
                hidden.extend(out.hidden)
                if out.logits is not None:
                    logits.append(out.logits)
                start = end
        return hidden, (torch.cat(logits) if logits else None)

    # ---- tasks --------------------------------------------------------------------------------
    def embed(self, seqs: list[list[int]], dimensions: Optional[int] = None) -> list[torch.Tensor]:
        self._require("embed")
        if dimensions is not None:
            if not self.pooler.matryoshka:
                raise ValueError("dimensions: this model does not support Matryoshka representations")
            if not 1 <= dimensions <= self.runner.hidden_size:
                raise ValueError(f"dimensions must be in [1, {self.runner.hidden_size}], got {dimensions}")
        hidden, _ = self._forward(seqs)
        return pool(hidden, self.pooler, dimensions)

    def token_embed(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        self._require("token_embed")
        hidden, _ = self._forward(seqs)
        return [h.float().cpu() for h in hidden]

    def classify(self, seqs: list[list[int]], types: Optional[list[list[int]]] = None) -> torch.Tensor:
        self._require("classify")
        _, logits = self._forward(seqs, types)
        return classifier_scores(logits).cpu()

    def score(self, text_1: list[Prompt], text_2: list[Prompt]) -> tuple[list[float], int]:
        """Scores of the pairs (one text_1 against many text_2, or pairwise), and the tokens used."""
        if len(text_1) == 1 and len(text_2) > 1:
            text_1 = list(text_1) * len(text_2)
        if len(text_1) != len(text_2):
            raise ValueError(f"text_1 and text_2 must have the same length (or text_1 one item), got "
                             f"{len(text_1)} and {len(text_2)}")
        if not text_2:
            raise ValueError("text_2 must not be empty")
        if self.is_cross_encoder:
            if self.runner.num_labels != 1:
                raise ValueError(f"score needs a cross-encoder with one label; this classifier has {self.runner.num_labels}"
                                 " (use classify)")
            if not all(isinstance(t, str) for t in list(text_1) + list(text_2)):
                raise ValueError("text_1 / text_2: a cross-encoder scores texts (strings)")
            pairs = [self.tokenize_pair(a, b) for a, b in zip(text_1, text_2)]
            scores = self.classify([p[0] for p in pairs], [p[1] for p in pairs])
            return [float(s) for s in scores], sum(len(p[0]) for p in pairs)
        seqs_1 = [self.tokenize(t, "text_1") for t in text_1]
        seqs_2 = [self.tokenize(t, "text_2") for t in text_2]
        vecs = self.embed(seqs_1 + seqs_2)
        a, b = torch.stack(vecs[: len(seqs_1)]), torch.stack(vecs[len(seqs_1):])
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        return [float(c) for c in cos], sum(map(len, seqs_1 + seqs_2))

    def _require(self, task: str) -> None:
        if task not in self.supported_tasks:
            raise ValueError(f"task {task!r} is not supported by this model ({self.runner.arch}); it supports "
                             f"{', '.join(self.supported_tasks)}")

    def shutdown(self) -> None:
        pass
