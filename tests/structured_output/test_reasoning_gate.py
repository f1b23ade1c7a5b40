"""The reasoning gate: the tokens after the first end tag, however the output is split into steps."""
from hypothesis import given, strategies as st

from pagedllm.structured_output.reasoning_gate import ReasoningGate, prompt_closes_reasoning

END = (7, 8, 9)
START = (7, 9)


def _after_first_end(tokens):
    for i in range(len(tokens) - len(END) + 1):
        if tuple(tokens[i:i + len(END)]) == END:
            return tokens[i + len(END):]
    return None


@given(st.lists(st.sampled_from([1, 7, 8, 9]), max_size=40), st.lists(st.integers(1, 5), max_size=40))
def test_the_gate_opens_after_the_first_end_tag_whatever_the_steps(tokens, cuts):
    gate, pos, opened = ReasoningGate(END), 0, None
    for k in cuts + [len(tokens)]:
        step = tokens[pos:pos + k]
        pos += len(step)
        after = gate.feed(step)
        if after is not None:
            opened = after + tokens[pos:]
            break
        if pos >= len(tokens):
            break
    assert opened == _after_first_end(tokens)


def test_a_prompt_closes_the_reasoning_when_its_last_tag_is_an_end_tag():
    assert prompt_closes_reasoning([1, 7, 9, 2, 7, 8, 9, 3], START, END)
    assert not prompt_closes_reasoning([1, 7, 8, 9, 2, 7, 9], START, END)  # reopened: a template opening <think>
    assert not prompt_closes_reasoning([1, 2, 3], START, END)
