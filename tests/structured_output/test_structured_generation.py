"""Constrained generation end to end on the default model (a real byte-level BPE tokenizer):
every output parses and validates (jsonschema / re.fullmatch / choice membership / xgrammar's own
matcher for EBNF), greedy and sampled, n=2, mixed batches, preemption."""
import json
import random
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams as S  # noqa: E402
from structured_output.schemas import random_object_schema  # noqa: E402

PROMPTS = ["First Citizen:", "ROMEO:\nWhat", "KING HENRY:", "To be, or not", "Good morrow,", "MENENIUS:\nI"]
GRAMMAR = r'''
root ::= greeting " " name ("!" | ".")
greeting ::= "hello" | "good " ("morrow" | "night")
name ::= [A-Z] [a-z]{1,6}
'''


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, seed=0, max_num_seqs=64)


def _check(text: str, spec: S):
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        m = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(spec.grammar))
        assert m.accept_string(text) and m.is_completed(), text


def _random_schema_run(llm, num_schemas: int, seed: int) -> int:
    rng = random.Random(seed)
    params, prompts = [], []
    for i in range(num_schemas):
        schema = random_object_schema(rng)
        for temp, n in ((0.0, 1), (1.0, 2)):
            params.append(SamplingParams(max_tokens=400, temperature=temp, seed=seed + i, n=n,
                                         structured_outputs=S(json=schema)))
            prompts.append(PROMPTS[i % len(PROMPTS)])
    outs = llm.generate(prompts, params, use_tqdm=False)
    count = 0
    for o, sp in zip(outs, params):
        assert len(o.outputs) == sp.n
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.text, sp.structured_outputs.json)
            _check(c.text, sp.structured_outputs)
            count += 1
    return count


def test_random_json_schemas_validate(llm):
    """Outputs over random schemas, greedy and sampled (n=2): all stop, all validate."""
    assert _random_schema_run(llm, 24, 18) == 72


@pytest.mark.slow
def test_random_json_schemas_validate_hundreds(llm):
    assert _random_schema_run(llm, 100, 1800) == 300


def test_regex_choice_grammar_json_object(llm):
    specs = [S(regex=r"[a-z]{2,5}(-[0-9]{1,3})?"), S(regex=r"(yes|no|maybe) [0-9]{2}"),
             S(choice=["alpha", "beta gamma", "d\"elta"]), S(grammar=GRAMMAR)]
    prompts, params = [], []
    for k, spec in enumerate(specs):
        for temp in (0.0, 1.0):
            prompts.append(PROMPTS[k])
            params.append(SamplingParams(max_tokens=60, temperature=temp, seed=k, n=2, structured_outputs=spec))
    for o, sp in zip(llm.generate(prompts, params, use_tqdm=False), params):
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            _check(c.text, sp.structured_outputs)
    # any JSON object: strings are unbounded, so an output may run to max_tokens; one that stops parses
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=1.0, seed=5, structured_outputs=S(
        json_object=True)), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_guided_decoding_alias_and_dict(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, guided_decoding=S(choice=["a", "b"]))
    assert sp.structured_outputs.choice == ["a", "b"] and sp.guided_decoding is None
    sp2 = SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": "x+y"})
    out = llm.generate(["KING:"], [sp2], use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("x+y", out.text)


def test_free_requests_unchanged_by_constrained_neighbours(llm):
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in PROMPTS]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    rng = random.Random(3)
    mixed_prompts, mixed_params = [], []
    for p, sp in zip(PROMPTS, free):
        mixed_prompts += [p, p]
        mixed_params += [sp, SamplingParams(max_tokens=200, temperature=1.0, seed=rng.randrange(100),
                                            structured_outputs=S(json=random_object_schema(rng)))]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == alone
    for o, sp in zip(outs[1::2], mixed_params[1::2]):
        _check(o.outputs[0].text, sp.structured_outputs)


def test_grammar_end_after_max_tokens_is_length(llm):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 30, "maxLength": 40}},
              "required": ["a"], "additionalProperties": False}
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=5, temperature=0, structured_outputs=S(json=schema)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_ignore_eos_still_stops_at_grammar_end(llm):
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                                  structured_outputs=S(choice=["done"])), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("done")


@pytest.mark.parametrize("spec, field", [
    (S(json={"type": "objectx"}), "structured_outputs.json"),
    (S(json="{not json"), "structured_outputs.json"),
    (S(regex="(a"), "structured_outputs.regex"),
    (S(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_value_errors_naming_the_field(llm, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_params_shape_is_checked():
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))


def test_preemption_mid_output_keeps_outputs_valid(default_model):
    """A KV cache of a few blocks: constrained requests are preempted and recomputed mid-output,
    their matchers keep their place, and every output still validates."""
    llm = LLM(default_model, dtype="float32", kv_cache_memory=1 << 20, max_model_len=128, seed=0,
              enable_prefix_caching=False)
    rng = random.Random(7)
    schema = {"type": "object", "properties": {"w": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                                     "minItems": 30, "maxItems": 32}},
              "required": ["w"], "additionalProperties": False}
    specs = [S(json=schema), S(regex=r"([0-9] ){40,45}"), S(json=schema), S(regex=r"([a-z] ){40,45}")]
    params = [SamplingParams(max_tokens=110, temperature=1.0, seed=rng.randrange(99), structured_outputs=s)
              for s in specs]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    for o, sp in zip(outs, params):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        _check(o.outputs[0].text, sp.structured_outputs)


def test_min_tokens_does_not_block_the_grammar_end(llm):
    out = llm.generate(["KING:"], SamplingParams(max_tokens=30, min_tokens=20, temperature=0,
                                                 structured_outputs=S(choice=["ay"])), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == "ay"


def test_json_properties_come_in_schema_order(llm):
    """Regression: the schema was compiled with sorted keys, so ``reasoning`` (declared first)
    came out after ``answer``. Both orders of the same properties must be honoured."""
    props = {"reasoning": {"type": "string", "maxLength": 12}, "answer": {"type": "boolean"}}
    for order in (["reasoning", "answer"], ["answer", "reasoning"]):
        schema = {"type": "object", "properties": {k: props[k] for k in order}, "required": order,
                  "additionalProperties": False}
        sp = SamplingParams(max_tokens=200, temperature=0, structured_outputs=S(json=schema))
        text = llm.generate(["ROMEO:"], [sp], use_tqdm=False)[0].outputs[0].text
        assert list(json.loads(text)) == order, text


def test_async_scheduling_matches_with_constrained_requests(llm, default_model):
    """Async scheduling (issue 31) with constrained requests beside plain ones: steps go one at
    a time while a grammar runs (its mask needs the last token), so every greedy output is the
    synchronous engine's, constrained or not."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=S(regex=r"[A-Z][a-z]+ (is|was) [a-z]+\.")),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=S(choice=["yes", "no", "maybe"]))]
    prompts = PROMPTS[:4]
    want = llm.generate(prompts, params, use_tqdm=False)
    async_llm = LLM(default_model, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, seed=0,
                    max_num_seqs=64, async_scheduling=True)
    try:
        got = async_llm.generate(prompts, params, use_tqdm=False)
    finally:
        async_llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o, sp in zip(got, params):
        if sp.structured_outputs is not None:
            _check(o.outputs[0].text, sp.structured_outputs)


def _forcing(token_ids):
    """A logits processor making the output start with ``token_ids`` (what a thinking model writes)."""
    import torch

    def force(output_ids, logits):
        k = len(output_ids)
        if k < len(token_ids):
            logits = torch.full_like(logits, float("-inf"))
            logits[token_ids[k]] = 0.0
        return logits

    return force


@pytest.mark.parametrize("spec", [S(choice=["Verona", "Mantua", "Padua"]), S(json={"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False})])
def test_a_constraint_with_reasoning_tags_starts_after_the_reasoning(llm, spec):
    """reasoning_tags: the model's <think> ... </think> is free, the constraint holds after it;
    a prompt that already closed the reasoning gets the constraint from the first token."""
    thought = "Two and two make four.</think>"
    ids = llm.get_tokenizer().encode(thought, add_special_tokens=False)
    tagged = S(**{k: v for k, v in vars(spec).items() if v is not None}, reasoning_tags=("<think>", "</think>"))
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=tagged, logits_processors=[_forcing(ids)])
    out = llm.generate(["First Citizen:"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(thought), out.text
    _check(out.text[len(thought):].lstrip("\n"), spec)
    closed = llm.generate(["First Citizen: <think>done</think>\n"], SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=tagged), use_tqdm=False)[0].outputs[0]
    _check(closed.text, spec)
