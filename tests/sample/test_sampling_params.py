import pytest

from pagedllm import SamplingParams

BAD = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", 1000), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1), ("seed", "x"), ("seed", 2**64), ("top_k", 2**40), ("max_tokens", 0),
    ("max_tokens", -5), ("min_tokens", -1), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("repetition_penalty", 3.0), ("logit_bias", {1: 200.0}), ("logprobs", -1), ("logprobs", 21),
    ("prompt_logprobs", 50), ("ignore_eos", "yes"), ("skip_special_tokens", 1),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="x", top_k=-1, temperature=0)
    assert sp.stop == ["x"] and sp.top_k == 0 and sp.is_greedy
