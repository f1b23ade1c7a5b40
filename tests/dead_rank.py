"""Shared check of the multi-process executors' failure path: a rank killed between steps makes
the next request fail with an error naming it, within the 30 s the multi-machine issue allows
(a hang would show as the test's timeout instead)."""
import os
import signal
import time

import pytest


def assert_killed_rank_fails_fast(llm, prompts, sampling_params) -> None:
    ex = llm.engine.core.executor
    os.kill(ex.procs[0].pid, signal.SIGKILL)
    ex.procs[0].join(5)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        llm.generate(prompt_token_ids=prompts, sampling_params=sampling_params, use_tqdm=False)
    assert time.monotonic() - t < 30
    llm.engine.shutdown()
