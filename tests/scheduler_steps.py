"""A model-free step for scheduler tests: every request that finished its prompt samples token 7."""
from pagedllm.core.contracts import ModelRunnerOutput


def fake_step(s):
    """Schedule one step, feed back a hand-made runner output; returns (SchedulerOutput, outputs)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    return so, s.update_from_output(so, ModelRunnerOutput(ids, sampled))
