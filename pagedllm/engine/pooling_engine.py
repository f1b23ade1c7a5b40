"""The pooling engine (``runner="pooling"``): inputs tokenized and validated once, packed into
batches of at most ``max_num_batched_tokens`` tokens / ``max_num_seqs`` sequences, each batch ONE
forward of the pooling runner (worker/pooling_runner.py), results pooled per input.

Tasks, in vLLM's names: ``embed`` (one vector per input; Matryoshka ``dimensions`` where the
model supports it), ``token_embed`` (every token's vector), ``classify`` (a classifier's
scores), ``score`` (a cross-encoder's score of each (text_1, text_2) pair, or the cosine of two
embeddings for an embedding model).

Thread-safe, and concurrent callers (the server's requests) share forwards: a caller whose inputs
arrive while a forward runs waits; when it ends, one waiting caller takes every input queued so
far into the next forwards and hands each caller its rows.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence, Union

import torch

from pagedllm.config import EngineConfig, hf_field, resolve_max_model_len, resolve_max_num_batched_tokens
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
    return any(is_pooling_architecture(a) for a in (hf_field(hf_config, "architectures") or []))


class RequestLimitError(ValueError):
    """A request over one of its per-request bounds (EngineConfig's max_pooling_*); ``param``
    is the request field it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_budget(tokens: int, max_tokens: Optional[int], field: str) -> None:
    """RequestLimitError when a request's inputs hold more than ``max_tokens`` tokens (None: no bound)."""
    if max_tokens is not None and tokens > max_tokens:
        raise RequestLimitError(f"{field}: the request's inputs hold at least {tokens} tokens, more than the "
                                f"{max_tokens} one request may carry (max_pooling_tokens)", field)


class _Job:
    __slots__ = ("seqs", "types", "hidden", "logits", "error", "done")

    def __init__(self, seqs, types) -> None:
        self.seqs, self.types = seqs, types
        self.hidden, self.logits, self.error, self.done = None, None, None, False


class ForwardBatcher:
    """Callers' sequences gathered into shared forwards (``run(seqs, types) -> (hidden, logits)``
    over the lot); one forward runs at a time."""

    def __init__(self, run) -> None:
        self.run = run
        self.pending: list[_Job] = []
        self.busy = False
        self.cv = threading.Condition()

    def forward(self, seqs, types=None):
        job = _Job(seqs, types)
        with self.cv:
            self.pending.append(job)
            while self.busy and not job.done:
                self.cv.wait()
            if not job.done:  # this caller leads the next forwards, for every job queued so far
                self.busy, jobs, self.pending = True, self.pending, []
        if job.done:
            return self._result(job)
        try:
            all_seqs = [s for j in jobs for s in j.seqs]
            all_types = None
            if any(j.types is not None for j in jobs):
                all_types = [t for j in jobs for t in (j.types if j.types is not None else [[0] * len(s) for s in j.seqs])]
            try:
                hidden, logits = self.run(all_seqs, all_types)
            except BaseException as e:
                for j in jobs:
                    j.error = e
            else:
                start = 0
                for j in jobs:
                    n = len(j.seqs)
                    j.hidden = hidden[start : start + n]
                    j.logits = logits[start : start + n] if logits is not None else None
                    start += n
        finally:
            with self.cv:
                for j in jobs:
                    j.done = True
                self.busy = False
                self.cv.notify_all()
        return self._result(job)

    @staticmethod
    def _result(job: _Job):
        if job.error is not None:
            raise job.error
        return job.hidden, job.logits


class PoolingEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.hf_config = hf_config = load_hf_config(config.model)
        limit = resolve_max_model_len(hf_config, config.max_model_len)
        if hf_field(hf_config, "model_type", "") in ("xlm-roberta", "roberta"):  # positions from pad_token_id + 1
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
        self.batcher = ForwardBatcher(self._run_batches)

    @property
    def labels(self) -> list[str]:
        """A classifier's label names, in order: its config's id2label (keys as ints or the JSON's
        strings), ``LABEL_i`` where it names none (transformers' default)."""
        id2label = {int(k): str(v) for k, v in (hf_field(self.hf_config, "id2label") or {}).items()}
        return [id2label.get(i, f"LABEL_{i}") for i in range(max(self.runner.num_labels, 1))]

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("classify", "score") if self.is_cross_encoder else ("embed", "token_embed", "score")

    # ---- inputs -------------------------------------------------------------------------------
    def truncation(self, truncate_prompt_tokens: Optional[int]) -> Optional[int]:
        """vLLM's ``truncate_prompt_tokens``: None (no truncation), N >= 1, or -1 (max_model_len);
        ValueError naming the field otherwise."""
        t = truncate_prompt_tokens
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, int) or not (t >= 1 or t == -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {t!r}")
        if t > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({t}) must be at most max_model_len ({self.max_model_len})")
        return self.max_model_len if t == -1 else t

    def tokenize(self, prompt: Prompt, field: str = "input", truncate: Optional[int] = None) -> list[int]:
        """Token ids of a string (with the model's special tokens) or a checked list of ids.
        ``truncate`` (a checked truncation()): a text keeps the tokenizer's first N tokens, its
        special tokens included (the tokenizer's own truncation); token ids keep their last N."""
        if isinstance(prompt, str):
            kw = {"truncation": True, "max_length": truncate} if truncate is not None else {}
            ids = self.tokenizer(prompt, add_special_tokens=True, **kw)["input_ids"]
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{field}: token ids must be integers in [0, {self.vocab_size})")
            if truncate is not None:
                ids = ids[-truncate:]
        return self._check_length(ids, field)

    def tokenize_pair(self, a: str, b: str, truncate: Optional[int] = None) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: both texts with the tokenizer's separators and segment ids
        (``truncate``: at most N tokens, the longer text shortened first, separators kept). The
        segment ids are the tokenizer's own only where its ``model_input_names`` has
        ``token_type_ids`` (as HF and sentence-transformers feed the model); else all 0, the
        model's default."""
        kw = {"truncation": True, "max_length": truncate} if truncate is not None else {}
        enc = self.tokenizer(a, b, add_special_tokens=True, return_token_type_ids=self.uses_token_types, **kw)
        ids = self._check_length(enc["input_ids"], "text")
        if not self.uses_token_types or (hf_field(self.hf_config, "type_vocab_size", 2) or 1) < 2:
            return ids, [0] * len(ids)  # XLM-RoBERTa: one segment embedding
        return ids, list(enc["token_type_ids"])

    @property
    def uses_token_types(self) -> bool:
        """Whether the tokenizer hands the model segment ids (``token_type_ids`` in its model_input_names)."""
        return "token_type_ids" in self.tokenizer.model_input_names  # a transformers tokenizer's (AutoTokenizer)

    def _check_length(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise ValueError(f"{field}: an input must have at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{field}: an input of {len(ids)} tokens exceeds max_model_len ({self.max_model_len})")
        return ids

    # ---- batching -----------------------------------------------------------------------------
    def _forward(self, seqs: list[list[int]], types: Optional[list[list[int]]] = None):
        """Hidden states (and logits) of every sequence, in order (shared forwards with other callers)."""
        return self.batcher.forward(seqs, types)

    def _run_batches(self, seqs: list[list[int]], types: Optional[list[list[int]]] = None):
        """As few forwards as the token and sequence budgets allow."""
        hidden, logits, start = [], [], 0
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

    def score(self, text_1: list[Prompt], text_2: list[Prompt], truncate: Optional[int] = None,
              max_tokens: Optional[int] = None, field: str = "text_2",
              names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list[float], int]:
        """Scores of the pairs (one text_1 against many text_2, or pairwise), and the tokens used;
        ``names``: the two sides' request fields, as the errors name them (/score's text_1 /
        text_2, or vLLM's queries / documents);
        ``truncate``: a checked truncation() for each pair (cross-encoder) or each text;
        ``max_tokens``: the most tokens all of them may hold (more: RequestLimitError naming
        ``field`` and max_pooling_tokens), checked before any forward."""
        n1, n2 = names
        if len(text_1) == 1 and len(text_2) > 1:
            text_1 = list(text_1) * len(text_2)
        if len(text_1) != len(text_2):
            raise ValueError(f"{n1} and {n2} must have the same length (or {n1} one item), got "
                             f"{len(text_1)} and {len(text_2)}")
        if not text_2:
            raise ValueError(f"{n2} must not be empty")
        if self.is_cross_encoder:
            if self.runner.num_labels != 1:
                raise ValueError(f"score needs a cross-encoder with one label; this classifier has {self.runner.num_labels}"
                                 " (use classify)")
            if not all(isinstance(t, str) for t in list(text_1) + list(text_2)):
                raise ValueError(f"{n1} / {n2}: a cross-encoder scores texts (strings)")
            pairs = [self.tokenize_pair(a, b, truncate) for a, b in zip(text_1, text_2)]
            tokens = sum(len(p[0]) for p in pairs)
            check_token_budget(tokens, max_tokens, field)
            scores = self.classify([p[0] for p in pairs], [p[1] for p in pairs])
            return [float(s) for s in scores], tokens
        seqs_1 = [self.tokenize(t, n1, truncate) for t in text_1]
        seqs_2 = [self.tokenize(t, n2, truncate) for t in text_2]
        check_token_budget(sum(map(len, seqs_1 + seqs_2)), max_tokens, field)
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
