"""Issue 29 item 9: engines built and dropped one after another in one Python process -- one
process, then pipeline parallel, then pipeline x tensor parallel -- each with a rendezvous store
and process group of its own; a dropped engine's workers are gone; a rank that cannot join fails
the constructor fast, naming it; an engine still in use blocks a second one with a clear error."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("lifecycle") / "llama4"), "llama", layers=4, heads=4,
                           kv_heads=2)


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP,
                                                           use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_engines_one_after_another_in_one_process(ckpt):
    import torch.distributed as dist

    kw = dict(model=ckpt, dtype="float32", kv_cache_memory=4 << 20)
    llm = LLM(**kw)
    want = _greedy(llm)
    del llm
    pids = []
    for parallel in (dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, tensor_parallel_size=2)):
        t0 = time.monotonic()
        llm = LLM(**kw, **parallel)
        assert time.monotonic() - t0 < 240
        procs = list(llm.engine.core.executor.procs)
        assert _greedy(llm) == want, parallel
        pids += [p.pid for p in procs]
        del llm, procs  # no shutdown(): garbage collection tears the engine down
        gc.collect()
        assert not dist.is_initialized()
    for pid in pids:  # every worker of both engines is gone
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    llm = LLM(**kw, pipeline_parallel_size=2)  # and explicit shutdown() works the same way
    try:
        assert _greedy(llm) == want
        with pytest.raises(RuntimeError, match="another multi-process engine .* is still running"):
            LLM(**kw, pipeline_parallel_size=2)
    finally:
        llm.shutdown()
    assert not dist.is_initialized() and not any(p.is_alive() for p in llm.engine.core.executor.procs)


def _exit_at_once(code: int) -> None:
    os._exit(code)


def _never_join() -> None:
    time.sleep(60)


def test_a_rank_that_cannot_join_fails_fast_naming_it():
    """Ranks 1 and 2 of a world of 3: rank 1 joins the store; rank 2 exits before joining (the
    constructor fails at once, naming it), or stays alive without joining (fails at the timeout)."""
    from pagedllm.distributed.parallel_state import join_store, serve_store, wait_for_ranks

    store = serve_store(3, timeout_s=10)
    ctx = mp.get_context("spawn")
    rank1, dead, silent = (ctx.Process(target=_never_join, daemon=True), ctx.Process(target=_exit_at_once, args=(3,)),
                           ctx.Process(target=_never_join, daemon=True))
    for p in (rank1, dead, silent):
        p.start()
    try:
        dead.join(60)
        join_store(store.port, 3, timeout_s=10)  # rank 1's join (from here: it is its count that matters)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 2 exited \(code 3\) before joining the process group"):
            wait_for_ranks(store, [rank1, dead], timeout_s=30)
        assert time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError, match="1 of the engine's 2 worker ranks did not join the process group "
                                               "within 1 s"):
            wait_for_ranks(store, [rank1, silent], timeout_s=1)
    finally:
        for p in (rank1, silent):
            p.kill()
            p.join(10)
