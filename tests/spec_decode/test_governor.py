"""The governor keeps speculating while it pays and decodes plainly when the measured costs say
speculation loses (synthetic clocks: deterministic)."""
from pagedllm.spec_decode.governor import SpecGovernor


def drive(gov, steps, t_spec, t_plain, tokens):
    now, modes = 0.0, []
    for _ in range(steps):
        spec = gov.begin_step(True, now)
        modes.append(spec)
        if spec:
            gov.record_tokens(tokens)
        now += t_spec if spec else t_plain
    return modes


def test_keeps_speculating_when_it_pays():
    gov = SpecGovernor(window=10, probe=2)
    modes = drive(gov, 200, t_spec=1.5, t_plain=1.0, tokens=3.0)  # 2 tokens/unit vs 1
    assert sum(modes[20:]) >= 0.8 * 180 and gov.speculation_pays


def test_stops_when_it_loses():
    gov = SpecGovernor(window=10, probe=2)
    modes = drive(gov, 200, t_spec=3.0, t_plain=1.0, tokens=1.5)  # 0.5 tokens/unit vs 1
    assert not gov.speculation_pays
    assert sum(modes[20:]) <= 0.2 * 180  # only the probes speculate
    assert gov.num_plain_steps >= 140


def test_non_decode_steps_are_not_measured():
    gov = SpecGovernor(window=100, probe=2)
    gov.begin_step(False, 0.0)
    gov.begin_step(True, 50.0)  # a long prefill step before: not a speculative step's cost
    assert gov.t_spec is None
