"""Engine logprobs (per position: {token id: Logprob}, sampled token first) -> OpenAI formats:
the legacy completions format (tokens / token_logprobs / top_logprobs / text_offset) and the
chat format (content: [{token, logprob, bytes, top_logprobs}])."""
from __future__ import annotations

import math
from typing import Optional

from pagedllm.entrypoints.openai.protocol import (
    ChatLogprobs, ChatLogprobToken, ChatTopLogprob, CompletionLogprobs, LogprobInfo, PromptLogprobsOut,
)
from pagedllm.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -inf


def _clamp(x: float) -> float:
    return _FLOOR if (x != x or x == -math.inf or x < _FLOOR) else float(x)


def _text(tid: int, lp: Optional[Logprob], tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else str(tid)


def _sampled(tid: int, d: dict[int, Logprob]) -> Optional[Logprob]:
    lp = d.get(tid)
    if lp is None and d:
        lp = next(iter(d.values()))
    return lp


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer,
                        offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for tid, d in zip(token_ids, logprobs):
        lp = _sampled(tid, d)
        tok = _text(tid, lp, tokenizer)
        out.tokens.append(tok)
        out.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
        out.top_logprobs.append({_text(t, v, tokenizer): _clamp(v.logprob) for t, v in d.items()})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def _top(d: Optional[dict[int, Logprob]], tid: int, n: Optional[int]) -> Optional[dict[int, Logprob]]:
    """The prompt token's entry and the top ``n`` (the engine computed the largest N asked for)."""
    if not d or n is None:
        return d
    return {t: v for t, v in d.items() if t == tid or (v.rank is not None and v.rank <= n)}


def prompt_logprobs(prompt_ids: list[int], logprobs, n: int, tokenizer) -> Optional[PromptLogprobsOut]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt's token and the top ``n``."""
    if logprobs is None:
        return None
    out: PromptLogprobsOut = []
    for j, tid in enumerate(prompt_ids):
        d = _top(logprobs[j] if j < len(logprobs) else None, tid, n)
        out.append(None if not d else {t: LogprobInfo(logprob=_clamp(v.logprob), rank=v.rank,
                                                        decoded_token=_text(t, v, tokenizer)) for t, v in d.items()})
    return out


def completion_prompt_logprobs(prompt_ids: list[int], prompt_logprobs, tokenizer,
                               n: Optional[int] = None) -> CompletionLogprobs:
    """Echo: the prompt's tokens (the first has no logprob), with the top ``n`` of each."""
    out = CompletionLogprobs()
    offset = 0
    for j, tid in enumerate(prompt_ids):
        d = prompt_logprobs[j] if prompt_logprobs is not None and j < len(prompt_logprobs) else None
        d = _top(d, tid, n)
        lp = d.get(tid) if d else None
        tok = _text(tid, lp, tokenizer)
        out.tokens.append(tok)
        out.token_logprobs.append(_clamp(lp.logprob) if lp is not None else None)
        out.top_logprobs.append({_text(t, v, tokenizer): _clamp(v.logprob) for t, v in d.items()} if d else None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def prepend(a: Optional[CompletionLogprobs], b: Optional[CompletionLogprobs]) -> Optional[CompletionLogprobs]:
    if a is None or b is None:
        return b if a is None else a
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, tokenizer) -> ChatLogprobs:
    content = []
    for tid, d in zip(token_ids, logprobs):
        lp = _sampled(tid, d)
        tok = _text(tid, lp, tokenizer)
        ranked = sorted(((v.rank, t, v) for t, v in d.items() if v.rank is not None and v.rank <= top_n),
                        key=lambda x: x[0])[:top_n]
        top = []
        for _, t, v in ranked:
            s = _text(t, v, tokenizer)
            top.append(ChatTopLogprob(token=s, logprob=_clamp(v.logprob), bytes=_bytes(s)))
        content.append(ChatLogprobToken(token=tok, logprob=_clamp(lp.logprob) if lp is not None else _FLOOR,
                                        bytes=_bytes(tok), top_logprobs=top))
    return ChatLogprobs(content=content)
