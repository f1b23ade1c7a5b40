"""SamplingParams: how one request is decoded. Validated on construction (ValueError names the field)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

_GREEDY_EPS = 1e-5

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def token_id_key(key) -> int:
    """A logit_bias key: an int, or its decimal digits as text ("50"). Python's int() also takes
    "5_0", " 50", "+50" and non-ASCII digits; a token id written so is refused, not guessed."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit():
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids (decimal digits), got {key!r}")


def _bias_value(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"logit_bias values must be numbers, got {v!r}")
    return float(v)


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's shape): ``json`` (a JSON schema, as a dict or its JSON
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF/GBNF text) or
    ``json_object=True`` (any JSON object). Exactly one is set; the shape is checked here and
    the constraint itself (does the schema/regex/grammar compile?) by the engine when the
    request is added (structured_output/)."""

    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # xgrammar's structural tag (vLLM's response_format type structural_tag), as a dict or its JSON
    # text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (free text until a trigger,
    # then the schema inside begin...end), or xgrammar's newer {"format": {...}}
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    # (start, end) tags of a thinking model's reasoning ("<think>", "</think>"): the constraint applies
    # to the output after the end tag (at once if the prompt already closed the reasoning), vLLM's
    # rule under --reasoning-parser; None: from the first token
    reasoning_tags: Optional[tuple[str, str]] = None

    def _set_constraints(self) -> list[str]:
        """The names of the constraints given (in _CONSTRAINTS' order)."""
        values = (self.json, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag)
        return [n for n, v in zip(_CONSTRAINTS, values) if v not in (None, False)]

    def __post_init__(self) -> None:
        set_ = self._set_constraints()
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}, got "
                             f"{', '.join(set_) if set_ else 'none'}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(f"structured_outputs.structural_tag must be an object or its JSON text, got "
                             f"{type(self.structural_tag).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name, v in (("regex", self.regex), ("grammar", self.grammar)):
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.reasoning_tags is not None:
            tags = self.reasoning_tags
            if not isinstance(tags, (list, tuple)) or len(tags) != 2 or not all(isinstance(t, str) and t for t in tags):
                raise ValueError(f"structured_outputs.reasoning_tags must be two non-empty strings (start, end), "
                                 f"got {tags!r}")
            self.reasoning_tags = (tags[0], tags[1])

    @property
    def kind(self) -> str:
        return self._set_constraints()[0]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Sample best_of sequences, return the n with the highest mean logprob per token (OpenAI's
    # definition; engine/best_of.py). None: best_of = n.
    best_of: Optional[int] = None
    # An output constraint (JSON schema, regex, choice, grammar, JSON object); ``guided_decoding``
    # is accepted as its older name.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = field(default=None, repr=False)
    # vLLM's extras: words never generated (each as its tokens, with and without a leading space;
    # a multi-token word's last token is banned after the rest), the only token ids allowed,
    # callables (output_token_ids, logits) -> logits or (prompt_token_ids, output_token_ids,
    # logits) -> logits run on each step's logits row (offline: they must pickle to reach worker
    # processes), the prompt's last N tokens kept (-1: as many as max_model_len allows), and
    # detokenize=False for token ids only (no text).
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[int]] = None
    logits_processors: Optional[list[Any]] = None
    truncate_prompt_tokens: Optional[int] = None
    detokenize: bool = True
    # vLLM's extra_args (vllm_xargs in a request): what custom batch logits processors
    # (--logits-processors) read per request; nothing else looks at them
    extra_args: Optional[dict[str, Any]] = None
    # Filled in by the engine: all stop token ids including EOS (unless ignore_eos).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the engine: bad_words as token id sequences.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got {type(self.logit_bias).__name__}")
            self.logit_bias = {token_id_key(k): _bias_value(v) for k, v in self.logit_bias.items()}
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs is not self.guided_decoding:
                raise ValueError("structured_outputs and guided_decoding (its older name) are both set: pass one")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        self._validate()
        self._all_stop_token_ids = set(self.stop_token_ids)

    # ---- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"an integer >= n ({self.n}) or None", self.best_of)
        if not is_num(self.temperature) or not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise bad("temperature", "a number in [0, 100]", self.temperature)
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "a number in (0, 1]", self.top_p)
        if not is_int(self.top_k) or self.top_k < 0 or self.top_k >= 2**31:
            raise bad("top_k", "an integer in [1, 2^31), or 0/-1 to disable", self.top_k)
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "a number in [0, 1]", self.min_p)
        if self.seed is not None and (not is_int(self.seed) or not (-(2**63) <= self.seed < 2**63)):
            raise bad("seed", "a 64-bit signed integer or None", self.seed)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a list of non-empty strings", self.stop)
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        if not is_num(self.presence_penalty) or not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad("presence_penalty", "a number in [-2, 2]", self.presence_penalty)
        if not is_num(self.frequency_penalty) or not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad("frequency_penalty", "a number in [-2, 2]", self.frequency_penalty)
        if not is_num(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 2.0):
            raise bad("repetition_penalty", "a number in (0, 2]", self.repetition_penalty)
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if k < 0 or not (-100.0 <= v <= 100.0):
                    raise bad("logit_bias", "a map of token id >= 0 to a bias in [-100, 100]", {k: v})
        if self.logprobs is not None and (not is_int(self.logprobs) or not (0 <= self.logprobs <= 20)):
            raise bad("logprobs", "an integer in [0, 20] or None", self.logprobs)
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not (0 <= self.prompt_logprobs <= 20)
        ):
            raise bad("prompt_logprobs", "an integer in [0, 20] or None", self.prompt_logprobs)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise bad(name, "a boolean", value)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w
                                                                        for w in self.bad_words):
                raise bad("bad_words", "a list of non-empty strings", self.bad_words)
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
                raise bad("allowed_token_ids", "a non-empty list of token ids >= 0", self.allowed_token_ids)
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, (list, tuple)) or not all(callable(f) for f in self.logits_processors):
                raise bad("logits_processors", "a list of callables", self.logits_processors)
            self.logits_processors = list(self.logits_processors)
        if self.extra_args is not None and (not isinstance(self.extra_args, dict)
                                            or not all(isinstance(k, str) for k in self.extra_args)):
            raise bad("extra_args", "a map of names to values", self.extra_args)
        if not self.detokenize and self.stop:
            raise bad("stop", "empty when detokenize is False (stop strings are matched on the text)", self.stop)
        if self.truncate_prompt_tokens is not None and (
                not is_int(self.truncate_prompt_tokens) or not (self.truncate_prompt_tokens >= 1
                                                                or self.truncate_prompt_tokens == -1)):
            raise bad("truncate_prompt_tokens", "an integer >= 1, -1 (max_model_len) or None",
                      self.truncate_prompt_tokens)

    # ---- derived ----------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_logits_masks(self) -> bool:
        """bad_words, allowed_token_ids or logits processors: the sampler must see this row."""
        return bool(self.bad_words or self.allowed_token_ids or self.logits_processors)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's EOS token(s) (with_eos), unless ignore_eos."""
        return self._all_stop_token_ids

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def with_eos(self, eos_token_ids) -> "SamplingParams":
        """Record the model's EOS token(s) as stop tokens (unless ignore_eos)."""
        stops = set(self.stop_token_ids)
        if eos_token_ids is not None and not self.ignore_eos:
            stops.update([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self._all_stop_token_ids = stops
        return self

    def with_bad_words(self, tokenizer) -> "SamplingParams":
        """Tokenize ``bad_words`` (each with and without a leading space, as vLLM)."""
        seqs: list[list[int]] = []
        for word in self.bad_words or []:
            if tokenizer is None:
                raise ValueError("bad_words needs the engine's tokenizer")
            bare = word.lstrip()
            for text in ((bare, " " + bare) if bare else (word,)):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self._bad_words_token_ids = seqs
        return self

    def clone(self, **changes) -> "SamplingParams":
        import copy

        new = copy.copy(self)
        for k, v in changes.items():
            setattr(new, k, v)
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        return new


@dataclass
class BeamSearchParams:
    """vLLM's fields (beam_width, max_tokens, ignore_eos, temperature, length_penalty,
    include_stop_str_in_output) plus HF's ``early_stopping`` (True, False or "never"), ``stop``
    strings, ``stop_token_ids`` and ``logprobs`` (top-n per generated token). Scores follow HF
    transformers: cumulative logprob / generated_tokens ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: Union[bool, str] = False
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search (it is deterministic, as HF's "
                             f"do_sample=False), got {self.temperature!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):  # any finite value scores (in log space)
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or (
                self.early_stopping in (0, 1) and not isinstance(self.early_stopping, bool)):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        # the remaining fields are checked as SamplingParams (ValueError naming the field)
        self.to_sampling_params()

    @property
    def structured_outputs(self) -> None:
        """Beam search takes no output constraint (the server refuses one)."""
        return None

    @property
    def n(self) -> int:
        """Sequences it runs at once (each beam counts toward max_n and admission limits)."""
        return self.beam_width

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              stop=self.stop, stop_token_ids=self.stop_token_ids, logprobs=self.logprobs,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)
