"""Server side of beam search and best_of (vLLM's extra fields; OpenAI's best_of).

``use_beam_search: true`` runs the request as one beam group (engine/beam_search.py) with ``n``
as the beam width (vLLM v1's meaning): the n choices are the n best beams, best score first.
``length_penalty`` and ``early_stopping`` (true, false or "never") follow HF transformers.
Beam search is deterministic: sampling fields (temperature other than 0, top_p, top_k, min_p,
penalties, logit_bias, seed, min_tokens), output constraints, forced tool calls, prompt
logprobs and streaming are refused with 400 naming the field, never ignored.

``best_of`` (completions, sampling): best_of candidates are sampled, the n with the highest
mean logprob per token returned; it must be >= n, and streaming with best_of > n is refused
(as OpenAI does: the best are known only at the end).
"""
from __future__ import annotations

from typing import Callable, Optional

from pagedllm.engine.beam_search import BeamSearchParams

_SAMPLING_ONLY = {  # field: its value when unset
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (None, 1.0), "logit_bias": (None, {}), "seed": (None,),
    "min_tokens": (0,), "prompt_logprobs": (None,),
}


def check_best_of(req, error: Callable[[str, str], Exception]) -> None:
    """A completion request's best_of against its n, use_beam_search and stream."""
    best_of = req.best_of
    if best_of is None:
        return
    if req.use_beam_search:
        if best_of != req.n:
            raise error("with use_beam_search, n is the beam width: best_of must be unset or equal n", "best_of")
        return
    if best_of < req.n:
        raise error(f"best_of must be >= n ({req.n}), got {best_of}", "best_of")
    if best_of > req.n and req.stream:
        raise error("best_of > n cannot be streamed (the best are known only at the end): set stream to false",
                    "best_of")


def _has_constraint(req) -> bool:
    rf = req.response_format
    return (rf is not None and rf.type != "text") or any(
        v is not None for v in (req.structured_outputs, req.guided_json, req.guided_regex, req.guided_choice,
                                req.guided_grammar))


def beam_search_params(req, max_tokens: Optional[int], logprobs: Optional[int], prompt_len: int, max_model_len: int,
                       error: Callable[[str, str], Exception], tool_choice=None) -> BeamSearchParams:
    """``req`` (a completion or chat request) as beam search; ``tool_choice``: a chat request's."""
    if req.stream:
        raise error("use_beam_search cannot be streamed (beams reorder until the search ends): set stream to false",
                    "stream")
    if req.temperature not in (None, 0, 0.0):
        raise error("use_beam_search is deterministic: temperature must be 0 or unset", "temperature")
    for name, unset in _SAMPLING_ONLY.items():
        if getattr(req, name) not in unset:
            raise error(f"{name} does not apply to beam search (use_beam_search)", name)
    if _has_constraint(req):
        raise error("structured outputs do not apply to beam search (use_beam_search)", "use_beam_search")
    if tool_choice not in (None, "none", "auto"):
        raise error("a forced tool_choice does not apply to beam search (use_beam_search)", "tool_choice")
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    elif prompt_len + max_tokens > max_model_len:
        raise error(f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
                    f"and max_tokens asks for {max_tokens} more", "max_tokens")
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty, early_stopping=req.early_stopping,
                                stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise error(str(e), "n" if field == "beam_width" else field) from None
