"""The benchmark workloads, named as vLLM's ``--dataset-name`` names them.

- ``random``: prompts of random token ids, lengths ``--input-len`` / ``--output-len`` (each drawn
  uniformly within ``--random-range-ratio`` of them), an optional shared ``--random-prefix-len``.
- ``sharegpt``: a ShareGPT-style JSON file (``--dataset-path``): a list of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``;
  the first turn is the prompt, the reply's length (tokenized) the output length unless
  ``--output-len`` is given.
- ``prefix-repetition``: ``--prefix-repetition-num-prefixes`` random prefixes, each request one
  of them plus a random suffix (what prefix caching is for).

Prompts are token-id lists where the dataset makes them so; a chat backend needs text, made by
decoding with ``--tokenizer`` or, without one, from a fixed word list (the server's usage
then gives the real prompt lengths).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional, Union

DATASETS = ("random", "sharegpt", "prefix-repetition")

# Text for chat prompts when there is no tokenizer to decode random ids with.
_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government number "
          "night point home water room mother area money story fact month lot right study book eye job word "
          "business issue side kind head house service friend father power hour game line end member law car "
          "city community name president team minute idea kid body information back parent face others level "
          "office door health person art war history party result change morning reason research girl guy "
          "moment air teacher force education foot boy age policy music market sense nation plan college "
          "interest death experience effect class control care field development role effort rate heart drug "
          "show leader light voice wife police mind price report decision son view relationship town road arm "
          "difference value building action model season society tax director position player record paper "
          "space ground form event official matter center couple site project activity star table need court "
          "oil situation cost industry figure street image phone data picture practice piece land product "
          "doctor wall patient worker news test movie north love support technology step baby computer type "
          "attention film tree source organization hair window evidence population truth").split()


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: a prompt (text or token ids), its length in tokens where known, and
    the number of output tokens asked for (sent as max_tokens, with ignore_eos)."""
    prompt: Union[str, list[int]]
    prompt_len: Optional[int]
    output_len: int


def load_tokenizer(name: Optional[str]):
    """The tokenizer of a local checkpoint directory (None when no name is given)."""
    if not name:
        return None
    if not os.path.isdir(name):
        raise ValueError(f"--tokenizer {name!r} is not a local directory (no model hub here)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _lengths(rng: random.Random, mean: int, ratio: float, n: int, field: str) -> list[int]:
    if mean < 1:
        raise ValueError(f"{field} must be >= 1, got {mean}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # ids 0-2 are often bos/eos/pad: keep them out of prompts
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def _vocab_size(tokenizer, given: Optional[int]) -> int:
    size = given or (len(tokenizer) if tokenizer is not None else 1000)
    if size <= 3:
        raise ValueError(f"random_vocab_size must be > 3, got {size}")
    return size


def random_requests(num: int, input_len: int, output_len: int, *, range_ratio: float = 0.0, prefix_len: int = 0,
                    vocab_size: int = 1000, seed: int = 0) -> list[SampleRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"random_prefix_len must be >= 0, got {prefix_len}")
    rng = random.Random(seed)
    ins = _lengths(rng, input_len, range_ratio, num, "input_len")
    outs = _lengths(rng, output_len, range_ratio, num, "output_len")
    prefix = _random_ids(rng, prefix_len, vocab_size)
    return [SampleRequest(prefix + _random_ids(rng, n, vocab_size), prefix_len + n, o) for n, o in zip(ins, outs)]


def prefix_repetition_requests(num: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, *,
                               vocab_size: int = 1000, seed: int = 0) -> list[SampleRequest]:
    for name, v in (("prefix_repetition_prefix_len", prefix_len), ("prefix_repetition_num_prefixes", num_prefixes),
                    ("prefix_repetition_output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if suffix_len < 0:
        raise ValueError(f"prefix_repetition_suffix_len must be >= 0, got {suffix_len}")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    reqs = [SampleRequest(prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab_size),
                          prefix_len + suffix_len, output_len) for i in range(num)]
    rng.shuffle(reqs)
    return reqs


def sharegpt_requests(path: str, num: int, *, tokenizer=None, output_len: Optional[int] = None,
                      seed: int = 0) -> list[SampleRequest]:
    if not path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-style JSON file)")
    from pagedllm.bench.results import read_json

    data = read_json(path, "dataset_path")
    if not isinstance(data, list):
        raise ValueError(f"dataset_path {path!r}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(prompt, str) and isinstance(reply, str) and prompt.strip():
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"dataset_path {path!r}: no conversation with a prompt and a reply")
    if output_len is None and tokenizer is None:
        raise ValueError("--dataset-name sharegpt measures output lengths with a tokenizer: give --tokenizer "
                         "(or --model as a local directory), or a fixed --output-len")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    reqs = []
    for prompt, reply in pairs:
        if len(reqs) == num:
            break
        plen = len(tokenizer(prompt).input_ids) if tokenizer is not None else None
        olen = output_len if output_len is not None else len(tokenizer(reply).input_ids)
        if olen < 1:
            continue
        reqs.append(SampleRequest(prompt, plen, olen))
    if len(reqs) < num:  # fewer conversations than prompts asked for: go round again
        reqs = [reqs[i % len(reqs)] for i in range(num)]
    return reqs


def as_text(req: SampleRequest, tokenizer, seed: int) -> SampleRequest:
    """The request with a text prompt (what a chat backend sends)."""
    if isinstance(req.prompt, str):
        return req
    if tokenizer is not None:
        return SampleRequest(tokenizer.decode(req.prompt), req.prompt_len, req.output_len)
    words = " ".join(_WORDS[t % len(_WORDS)] for t in req.prompt)
    return SampleRequest(words, None, req.output_len)


def sample_requests(args, tokenizer=None) -> list[SampleRequest]:
    """The workload the parsed ``pagedllm bench`` flags describe."""
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    vocab = _vocab_size(tokenizer, args.random_vocab_size)
    if args.dataset_name == "random":
        output_len = 128 if args.output_len is None else args.output_len
        return random_requests(args.num_prompts, args.input_len, output_len, range_ratio=args.random_range_ratio,
                               prefix_len=args.random_prefix_len, vocab_size=vocab, seed=args.seed)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len, vocab_size=vocab, seed=args.seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer=tokenizer,
                                 output_len=args.output_len, seed=args.seed)
    raise ValueError(f"dataset_name must be one of {', '.join(DATASETS)}, got {args.dataset_name!r}")
