"""/v1/completions: its request mapped onto the shared serving steps (serving_base), its outputs
(stream_consumer) mapped to completion choices, whole or as ``text_completion`` chunks.

Each prompt of the request is one engine request (``<id>-<i>``); choice ``i * n + k`` is prompt
i's k-th. ``echo`` puts the prompt (and its logprobs) before the text; ``max_tokens: 0`` with echo
scores the prompt (vLLM's), generating nothing.
"""
from __future__ import annotations

import uuid
from typing import Any, AsyncIterator, Iterable, Optional

from pagedllm.entrypoints.openai import logprobs as lp_format
from pagedllm.entrypoints.openai.beam import check_best_of
from pagedllm.entrypoints.openai.protocol_chunks import CompletionChunks
from pagedllm.entrypoints.openai.protocol_completions import CompletionChoice, CompletionRequest, CompletionResponse
from pagedllm.entrypoints.openai.serving_errors import APIError, bad_request
from pagedllm.entrypoints.openai.stream_consumer import Choice, Delta, SSEWriter, StreamConsumer
from pagedllm.outputs import RequestOutput


def prompt_list(prompt) -> list[Any]:
    """A completion request's prompts: a text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class ServingCompletions:
    def __init__(self, serving) -> None:
        self.serving = serving  # the ServingBase

    async def create(self, req: CompletionRequest, timeout: Optional[float] = None):
        """The response, or (streams, its chunks) when streaming."""
        serving = self.serving
        model = serving.check_model(req.model)
        self._check(req)
        prompts = [await serving.process(p, "prompt", req.truncate_prompt_tokens, req.add_special_tokens)
                   for p in prompt_list(req.prompt)]
        rid = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        # The engine computes the prompt's top-N once: N the larger of prompt_logprobs and echo's logprobs.
        asked = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
        prompt_n = max(asked) if asked else None
        items = []
        for i, (text, ids) in enumerate(prompts):
            if text is None and req.echo and serving.tokenizer is not None:
                text = serving.tokenizer.decode(ids)
            prompts[i] = (text, ids)
            params = serving.sampling_params(req, len(ids), req.max_tokens or (None if req.max_tokens is None else 1),
                                             req.logprobs, prompt_n, best_of=req.best_of)
            items.append((serving.engine_prompt(req, ids, text), params, f"{rid}-{i}"))
        serving.check_logprob_volume([(len(ids), p) for (_, p, _), (_, ids) in zip(items, prompts)],
                                     req.logprobs if req.echo else None, req.prompt_logprobs)
        if items:
            await serving.check_constraint(req, items[0][1])
        streams = await serving.start(items, serving.timeout(req, timeout), model)
        if req.stream:
            return streams, self.stream(req, streams, rid, model, prompts)
        return await self.full(req, streams, rid, model, prompts)

    def _check(self, req: CompletionRequest) -> None:
        if req.max_tokens == 0:  # vLLM's prompt scoring: echo the prompt (with its logprobs), generate nothing
            if not req.echo:
                raise bad_request("max_tokens 0 needs echo (it scores the prompt)", "max_tokens")
            if req.stream or req.n != 1 or req.use_beam_search or (req.best_of or 1) > 1:
                raise bad_request("max_tokens 0 (prompt scoring) is not available with stream, n > 1, best_of or "
                                  "beam search", "max_tokens")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        check_best_of(req, lambda msg, field: APIError(400, msg, param=field))
        if req.echo and req.logprobs is not None:
            self.serving.require_tokenizer("echo with logprobs needs a tokenizer", "echo")
        self.serving.check_prompt_logprobs(req)

    def echo_logprobs(self, out: RequestOutput, n: Optional[int]):
        if n is None:
            return None
        return lp_format.completion_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                    self.serving.tokenizer, n)

    async def full(self, req, streams, rid: str, model: str, prompts) -> CompletionResponse:
        consumer = StreamConsumer(streams, sum(len(ids) for _, ids in prompts))
        whole = await consumer.collect()
        result, completion_tokens = [], 0
        for (i, k), reply in whole.replies.items():
            # scoring: the one token generated is not part of the answer
            c = Choice(finish_reason="length") if req.max_tokens == 0 else reply.choice
            text, lps = "".join(c.text), None
            prefix = (prompts[i][0] or "") if req.echo else ""
            if req.logprobs is not None:
                lps = lp_format.completion_logprobs(c.token_ids, c.logprobs, self.serving.tokenizer, len(prefix))
            if req.echo:
                text = prefix + text
                lps = lp_format.prepend(self.echo_logprobs(whole.last[i], req.logprobs), lps)
            completion_tokens += len(c.token_ids)
            ids = (prompts[i][1], c.token_ids) if req.return_token_ids else (None, None)
            result.append(CompletionChoice(index=i * req.n + k, text=text, logprobs=lps,
                                           finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                           prompt_logprobs=self.serving.prompt_logprobs(req, whole.last.get(i)),
                                           prompt_token_ids=ids[0], token_ids=ids[1]))
        return CompletionResponse(id=rid, model=model, choices=result, usage=consumer.usage(completion_tokens))

    def stream(self, req, streams, rid: str, model: str, prompts) -> AsyncIterator[str]:
        consumer = StreamConsumer(streams, sum(len(ids) for _, ids in prompts))
        return consumer.stream(_CompletionWriter(self, req, consumer, rid, model, prompts))


class _CompletionWriter(SSEWriter):
    def __init__(self, adapter: ServingCompletions, req, consumer: StreamConsumer, rid: str, model: str,
                 prompts) -> None:
        super().__init__(req, consumer, lambda: CompletionChunks(rid, model))
        self.adapter, self.req, self.prompts = adapter, req, prompts
        self.sent: dict[tuple[int, int], int] = {}  # characters streamed per choice

    def delta(self, d: Delta) -> Iterable[str]:
        req, o, i = self.req, d.raw, d.prompt
        key = (i, o.index)
        prefix = (self.prompts[i][0] or "") if req.echo and d.first else ""
        text, lps = prefix + o.text, None
        if req.logprobs is not None:
            lps = lp_format.completion_logprobs(o.token_ids, o.logprobs or [], self.adapter.serving.tokenizer,
                                                self.sent.get(key, 0) + len(prefix))
        if req.echo and d.first:
            lps = lp_format.prepend(self.adapter.echo_logprobs(d.output, req.logprobs), lps)
        self.sent[key] = self.sent.get(key, 0) + len(text)
        if lps is None and not req.return_token_ids and not self.usage_each:  # the usual chunk
            return (self.chunks.text(i * req.n + o.index, text, o.finish_reason, o.stop_reason),)
        choice = CompletionChoice(index=i * req.n + o.index, text=text, logprobs=lps,
                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        if req.return_token_ids:
            choice.token_ids = list(o.token_ids)
            choice.prompt_token_ids = self.prompts[i][1] if d.first else None
        return (self.chunks.model_chunk([choice], self.usage_now()),)
