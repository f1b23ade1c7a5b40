"""``LLM``'s pooling methods (a mixin over ``self.pooling``, a PoolingEngine): embed, score,
encode, classify, with vLLM's signatures and result types (outputs.py)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from pagedllm.outputs import (ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingRequestOutput,
                                      ScoringOutput)

Prompts = Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]


def _as_list(prompts) -> list:
    """One prompt (a string or a list of ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class PoolingAPI:
    pooling = None

    def _pooling(self):
        if self.pooling is None:
            raise ValueError("this LLM generates text; embed / score / encode / classify need runner='pooling' (or "
                             "an encoder / classifier architecture)")
        return self.pooling

    def _inputs(self, prompts, prompt_token_ids=None, truncate_prompt_tokens: Optional[int] = None) -> list[list[int]]:
        """Each prompt's token ids; ``truncate_prompt_tokens`` (vLLM's: N >= 1, or -1 for
        max_model_len): a text keeps its first N tokens by the tokenizer's own truncation (special
        tokens kept), token ids their last N."""
        engine = self._pooling()
        truncate = engine.truncation(truncate_prompt_tokens)
        items = _as_list(prompt_token_ids) if prompt_token_ids is not None else _as_list(prompts)
        return [engine.tokenize(p, "input", truncate) for p in items]

    def embed(self, prompts: Optional[Prompts] = None, *, dimensions: Optional[int] = None,
              prompt_token_ids=None, use_tqdm: bool = False,
              truncate_prompt_tokens: Optional[int] = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (batched into as few forwards as the budgets allow)."""
        seqs = self._inputs(prompts, prompt_token_ids, truncate_prompt_tokens)
        vecs = self._pooling().embed(seqs, dimensions)
        return [PoolingRequestOutput(str(i), EmbeddingOutput(v.tolist()), s) for i, (v, s) in enumerate(zip(vecs, seqs))]

    def encode(self, prompts: Optional[Prompts] = None, *, pooling_task: str = "embed", prompt_token_ids=None,
               use_tqdm: bool = False, truncate_prompt_tokens: Optional[int] = None) -> list[PoolingRequestOutput]:
        """The raw pooled tensor per prompt: ``embed`` (one vector), ``token_embed`` (a vector per
        token) or ``classify`` (the class scores)."""
        seqs = self._inputs(prompts, prompt_token_ids, truncate_prompt_tokens)
        engine = self._pooling()
        if pooling_task == "embed":
            data = engine.embed(seqs)
        elif pooling_task == "token_embed":
            data = engine.token_embed(seqs)
        elif pooling_task == "classify":  # a row of class scores per prompt (one element for a single label)
            data = list(engine.classify(seqs).reshape(len(seqs), -1))
        else:
            raise ValueError(f"pooling_task must be 'embed', 'token_embed' or 'classify', got {pooling_task!r}")
        return [PoolingRequestOutput(str(i), PoolingOutput(d), s) for i, (d, s) in enumerate(zip(data, seqs))]

    def classify(self, prompts: Optional[Prompts] = None, *, prompt_token_ids=None,
                 use_tqdm: bool = False, truncate_prompt_tokens: Optional[int] = None) -> list[PoolingRequestOutput]:
        seqs = self._inputs(prompts, prompt_token_ids, truncate_prompt_tokens)
        scores = self._pooling().classify(seqs)
        return [PoolingRequestOutput(str(i), ClassificationOutput(p.reshape(-1).tolist()), s)
                for i, (p, s) in enumerate(zip(scores, seqs))]

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]], *,
              use_tqdm: bool = False, truncate_prompt_tokens: Optional[int] = None) -> list[PoolingRequestOutput]:
        """A cross-encoder's score of each (text_1, text_2) pair, or the cosine similarity of the
        two embeddings for an embedding model; one text_1 is scored against every text_2.
        ``truncate_prompt_tokens``: each pair (each text, for an embedding model) at most N tokens."""
        a, b = _as_list(text_1), _as_list(text_2)
        engine = self._pooling()
        scores, _ = engine.score(a, b, engine.truncation(truncate_prompt_tokens))
        return [PoolingRequestOutput(str(i), ScoringOutput(s), []) for i, s in enumerate(scores)]
