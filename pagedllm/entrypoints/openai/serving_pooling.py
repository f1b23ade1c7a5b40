"""The pooling routes' handlers over a PoolingEngine (engine/pooling_engine.py), and /tokenize and
/detokenize on a pooling server (the generating server's request and reply shapes).

A request is bounded up front (EngineConfig): at most ``max_pooling_inputs`` inputs (checked on
the event loop, before anything else), ``max_pooling_tokens`` tokens over them (tokenizing stops
at the first input past it) and ``max_pooling_output_values`` numbers in its reply (token_embed:
a vector per token; checked before the forwards); past one it is a 400 whose ``param`` names
the request field and whose message names the limit. Everything whose cost grows with a request
-- tokenizing, the engine's forwards (shared with other requests: the engine batches them),
building the JSON reply -- runs on a worker thread, never on the event loop: the reply's vectors
are encoded one at a time with msgspec into the bytes of the response, so /health and other
requests are answered meanwhile. Replies in vLLM's shapes."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Iterable, Optional

import msgspec
import numpy as np
import torch
from fastapi.responses import Response
from pydantic import BaseModel

from pagedllm.engine.pooling_engine import check_token_budget
from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingRequest, EmbeddingResponse,
    PoolingRequest, PoolingResponse, RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
    ScoreData, ScoreRequest, ScoreResponse)
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, UsageInfo
from pagedllm.entrypoints.openai.serving import APIError

# max_pooling_output_values when unset: 8M numbers (~170 MB as JSON at <= 20 bytes a number, 45 MB as
# base64), or one max_model_len input's token vectors where that is more
DEFAULT_MAX_OUTPUT_VALUES = 1 << 23


def _vector_json(vec: torch.Tensor, fmt: str) -> bytes:
    """One vector (or token_embed's matrix) as JSON: float, a list of numbers; base64, a string of
    its little-endian float32 bytes (what the openai client decodes)."""
    if fmt == "base64":
        return b'"' + base64.b64encode(np.ascontiguousarray(vec.float().numpy(), dtype="<f4").tobytes()) + b'"'
    return msgspec.json.encode(vec.float().tolist())


def _list_reply(envelope: BaseModel, kind: str, key: str, vectors: Iterable[torch.Tensor], fmt: str) -> bytes:
    """The JSON of ``envelope`` (a response model built with ``data=[]``) whose data are the items
    ``{"index": i, "object": kind, key: vector}``, each vector encoded on its own (the numbers of
    one at a time as Python floats, never the whole reply's)."""
    body = envelope.model_dump(mode="json")
    body["data"] = [{"index": i, "object": kind, key: msgspec.Raw(_vector_json(v, fmt))} for i, v in enumerate(vectors)]
    return msgspec.json.encode(body)


def _usage(tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def _run(fn, *args):
    """An engine call on the worker thread; its ValueError is a 400 (naming the request field
    where it is a RequestLimitError)."""
    try:
        return fn(*args)
    except ValueError as e:
        raise APIError(400, str(e), getattr(e, "param", None), "invalid_value") from None


class PoolingServing:
    def __init__(self, engine, served_model_names: list[str]) -> None:
        from pagedllm.tokenizer.tokenizer import max_token_chars

        self.engine = engine
        self.names = served_model_names
        self.max_model_len = engine.max_model_len
        config = engine.config
        self.max_inputs = config.max_pooling_inputs
        self.max_tokens = config.max_pooling_tokens
        self.max_output_values = config.max_pooling_output_values or max(
            DEFAULT_MAX_OUTPUT_VALUES, engine.max_model_len * engine.runner.hidden_size)
        # /tokenize: a longer text could never fit max_model_len (as on the generating server)
        self.max_prompt_chars = 2 * engine.max_model_len * max_token_chars(engine.tokenizer)
        self.num_in_flight = 0  # requests being answered (the server trims the heap only while none is)

    def _model(self, requested: Optional[str]) -> str:
        if requested is not None and requested not in self.names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {self.names[0]!r}",
                           "model", "model_not_found")
        return self.names[0]

    async def _reply(self, build, *args) -> Response:
        """``build(*args)`` (the JSON bytes of a reply: tokenizing, forwards, encoding) on a worker
        thread, as the response; counted in ``num_in_flight`` meanwhile."""
        self.num_in_flight += 1
        try:
            return Response(content=await asyncio.to_thread(build, *args), media_type="application/json")
        finally:
            self.num_in_flight -= 1

    def _truncation(self, req) -> Optional[int]:
        try:
            return self.engine.truncation(req.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens", "invalid_value") from None

    def _check_count(self, n: int, field: str) -> None:
        if n > self.max_inputs:
            raise APIError(400, f"{field}: {n} inputs, more than the {self.max_inputs} one request may carry "
                           "(max_pooling_inputs)", field, "invalid_value")

    def _items(self, value) -> list:
        """The request's inputs (one prompt -- a string or token ids -- or a list of them), checked
        against max_pooling_inputs; no work that grows with them (pydantic checked their types)."""
        items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not items:
            raise APIError(400, "input must not be empty", "input", "invalid_value")
        self._check_count(len(items), "input")
        return items

    def _tokenize(self, items: list, truncate: Optional[int]) -> list[list[int]]:
        """Each input's token ids (worker thread), stopping at the first past max_pooling_tokens."""
        seqs, total = [], 0
        try:
            for p in items:
                ids = self.engine.tokenize(p, "input", truncate)
                total += len(ids)
                check_token_budget(total, self.max_tokens, "input")
                seqs.append(ids)
        except ValueError as e:
            raise APIError(400, str(e), getattr(e, "param", "input"), "invalid_value") from None
        return seqs

    def _check_output(self, values: int, what: str) -> None:
        if values > self.max_output_values:
            raise APIError(400, f"input: the reply would carry {values} numbers ({what}), more than the "
                           f"{self.max_output_values} one reply may carry (max_pooling_output_values): send fewer "
                           "or shorter inputs", "input", "response_too_large")

    def _check_task(self, task: str, route: str) -> None:
        if task not in self.engine.supported_tasks:
            raise APIError(400, f"{route}: this model ({self.engine.runner.arch}) does not support {task!r}; it "
                           f"supports {', '.join(self.engine.supported_tasks)}", code="unsupported_task")

    # ---- /v1/embeddings, /pooling -------------------------------------------------------------
    async def create_embedding(self, req: EmbeddingRequest) -> Response:
        model = self._model(req.model)
        self._check_task("embed", "/v1/embeddings")
        items, truncate = self._items(req.input), self._truncation(req)
        return await self._reply(self._embedding_reply, req, model, items, truncate)

    def _embedding_reply(self, req: EmbeddingRequest, model: str, items: list, truncate: Optional[int]) -> bytes:
        seqs = self._tokenize(items, truncate)
        hidden = self.engine.runner.hidden_size
        self._check_output(len(seqs) * min(req.dimensions or hidden, hidden), "one vector per input")
        vecs = _run(self.engine.embed, seqs, req.dimensions)
        envelope = EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=[],
                                     usage=_usage(sum(map(len, seqs))))
        return _list_reply(envelope, "embedding", "embedding", vecs, req.encoding_format)

    async def create_pooling(self, req: PoolingRequest) -> Response:
        model = self._model(req.model)
        task = req.task or ("classify" if self.engine.is_cross_encoder else "embed")
        self._check_task(task, "/pooling")
        if req.dimensions is not None and task != "embed":
            raise APIError(400, "dimensions applies to task 'embed' only", "dimensions", "invalid_value")
        items, truncate = self._items(req.input), self._truncation(req)
        return await self._reply(self._pooling_reply, req, model, task, items, truncate)

    def _pooling_reply(self, req: PoolingRequest, model: str, task: str, items: list,
                       truncate: Optional[int]) -> bytes:
        seqs = self._tokenize(items, truncate)
        tokens, hidden = sum(map(len, seqs)), self.engine.runner.hidden_size
        if task == "embed":
            self._check_output(len(seqs) * min(req.dimensions or hidden, hidden), "one vector per input")
            out = _run(self.engine.embed, seqs, req.dimensions)
        elif task == "token_embed":
            self._check_output(tokens * hidden, f"token_embed: a vector of {hidden} for each of {tokens} tokens")
            out = _run(self.engine.token_embed, seqs)
        else:  # one list of class scores per input, a one-element list for a single-label head (as vLLM)
            self._check_output(len(seqs) * self.engine.runner.num_labels, "the class scores of each input")
            out = _run(self.engine.classify, seqs).reshape(len(seqs), -1)
        envelope = PoolingResponse(id=f"pool-{uuid.uuid4().hex}", created=int(time.time()), model=model, data=[],
                                   usage=_usage(tokens))
        return _list_reply(envelope, "pooling", "data", out, req.encoding_format)

    # ---- /classify ----------------------------------------------------------------------------
    async def create_classify(self, req: ClassificationRequest) -> Response:
        model = self._model(req.model)
        self._check_task("classify", "/classify")
        items, truncate = self._items(req.input), self._truncation(req)
        return await self._reply(self._classify_reply, model, items, truncate)

    def _classify_reply(self, model: str, items: list, truncate: Optional[int]) -> bytes:
        """vLLM's reply: each input's probabilities (softmax; a one-label head: [sigmoid]), the
        id2label name of the most probable class and the number of classes."""
        seqs = self._tokenize(items, truncate)
        labels = self.engine.labels
        self._check_output(len(seqs) * len(labels), "the class probabilities of each input")
        probs = _run(self.engine.classify, seqs).reshape(len(seqs), -1)
        data = [ClassificationData(index=i, label=labels[int(p.argmax())], probs=p.tolist(), num_classes=len(p))
                for i, p in enumerate(probs)]
        tokens = sum(map(len, seqs))
        return ClassificationResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                      data=data, usage=_usage(tokens)).model_dump_json().encode()

    # ---- /score, /rerank ----------------------------------------------------------------------
    async def create_score(self, req: ScoreRequest) -> Response:
        model = self._model(req.model)
        self._check_task("score", "/score")
        (n1, first), (n2, second) = self._score_sides(req)
        a = [first] if isinstance(first, str) else first
        b = [second] if isinstance(second, str) else second
        for name, side in ((n1, a), (n2, b)):
            if not side:
                raise APIError(400, f"{name} must not be empty", name, "invalid_value")
        self._check_count(max(len(a), len(b)), n1 if len(a) > len(b) else n2)
        truncate = self._truncation(req)

        def build() -> str:
            scores, tokens = _run(self.engine.score, a, b, truncate, self.max_tokens, n2, (n1, n2))
            return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                 data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=_usage(tokens)).model_dump_json()

        return await self._reply(build)

    @staticmethod
    def _score_sides(req: ScoreRequest) -> tuple[tuple[str, object], tuple[str, object]]:
        """The two sides of a /score request, each with its field name: text_1 / text_2, or
        queries / documents (vLLM 0.32's spelling); a 400 naming the field when both spellings
        are passed or a side is missing."""
        old, new = (req.text_1, req.text_2), (req.queries, req.documents)
        uses_new = any(v is not None for v in new)
        if uses_new and any(v is not None for v in old):
            field = "queries" if req.queries is not None else "documents"
            raise APIError(400, f"{field}: pass text_1 / text_2 or queries / documents, not both spellings", field,
                           "invalid_value")
        names, other, sides = (("queries", "documents"), "text_1 / text_2", new) if uses_new else \
            (("text_1", "text_2"), "queries / documents", old)
        for name, value in zip(names, sides):
            if value is None:
                raise APIError(400, f"{name} is required (or pass {other} instead)", name, "invalid_value")
        return (names[0], sides[0]), (names[1], sides[1])

    async def create_rerank(self, req: RerankRequest) -> Response:
        model = self._model(req.model)
        self._check_task("score", "/rerank")
        if not req.documents:
            raise APIError(400, "documents must not be empty", "documents", "invalid_value")
        self._check_count(len(req.documents), "documents")
        truncate = self._truncation(req)

        def build() -> str:
            scores, tokens = _run(self.engine.score, [req.query], req.documents, truncate, self.max_tokens,
                                  "documents")
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            if req.top_n:
                order = order[: req.top_n]
            results = [RerankResult(index=i, relevance_score=scores[i],
                                    document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                       for i in order]
            return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                                  usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump_json()

        return await self._reply(build)

    # ---- /tokenize, /detokenize ---------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> Response:
        """The generating server's /tokenize over the pooling model's tokenizer: a prompt (with
        the special tokens unless add_special_tokens is false), or messages rendered by the
        model's chat template (text content only)."""
        self._model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of prompt or messages", param="prompt")
        if req.prompt is not None and len(req.prompt) > self.max_prompt_chars:
            raise APIError(400, f"prompt is {len(req.prompt)} characters, more than the {self.max_prompt_chars} that "
                           f"max_model_len ({self.max_model_len} tokens) could ever hold", "prompt",
                           "context_length_exceeded")
        if req.messages is not None and not req.messages:
            raise APIError(400, "messages must be a non-empty list", "messages", "invalid_value")
        return await self._reply(self._tokenize_reply, req)

    def _tokenize_reply(self, req: TokenizeRequest) -> bytes:
        tokenizer = self.engine.tokenizer
        if req.prompt is not None:
            tokens = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            tokens = self._chat_tokens(req)
        # TokenizeResponse's fields, encoded without pydantic checking every id again
        return msgspec.json.encode({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    def _chat_tokens(self, req: TokenizeRequest) -> list[int]:
        from pagedllm.entrypoints.openai.chat_prompt import template_kwargs
        from pagedllm.entrypoints.openai.tool_calls import template_message
        from pagedllm.multimodal.chat_content import ContentError, flatten_content
        from pagedllm.tokenizer.tokenizer import apply_chat_template

        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                try:
                    content = flatten_content([p.model_dump(exclude_none=True) for p in content], None, [], None,
                                              f"messages[{i}].content")
                except ContentError as e:
                    raise APIError(400, str(e), param=e.param, code="invalid_value") from None
            messages.append(template_message(m, content or ""))
        if sum(len(m["content"]) for m in messages) > self.max_prompt_chars:
            raise APIError(400, f"the messages hold more than the {self.max_prompt_chars} characters that "
                           f"max_model_len ({self.max_model_len} tokens) could ever hold", "messages",
                           "context_length_exceeded")
        kwargs = template_kwargs(req.chat_template_kwargs)
        if self.engine.tokenizer.chat_template is None:
            raise APIError(400, "messages: this model's tokenizer has no chat template (send prompt instead)",
                           "messages", "invalid_value")
        try:
            return apply_chat_template(self.engine.tokenizer, messages, req.add_generation_prompt, **kwargs)
        except Exception as e:  # template errors are caused by the input
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """The generating server's /detokenize over the pooling model's tokenizer."""
        self._model(req.model)
        return await self._reply(self._detokenize_reply, req.tokens)

    def _detokenize_reply(self, tokens: list[int]) -> str:
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(tokens)).model_dump_json()
