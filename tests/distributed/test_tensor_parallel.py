"""Tensor parallelism on CPU with gloo: 2 ranks give the same tokens (greedy and seeded) and
logprobs as 1, with half the weights per rank; bad sizes fail clearly; a dead rank fails the
engine fast."""
import os
import signal
import time

import pytest

from dead_rank import assert_killed_rank_fails_fast
from one_engine import OneEngine
from prompts import random_prompts
from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts((1, 9, 40, 130, 260), seed=11)
CHUNK = 32  # the logprobs test's token budget (it splits the longer prompts); the dead-rank test reuses that engine
ENGINES = OneEngine(dtype="float32", kv_cache_memory=16 << 20)  # TP=2 engines; consecutive tests share one


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    ENGINES.close()


def generate(path, tp, prompts=PROMPTS, sp=SP, **kw):
    """(RequestOutputs, this run's preemptions, weight bytes per rank) of an engine with these
    settings (TP=2 ones shared through ENGINES); asserts no block leaked."""
    kw.setdefault("kv_cache_memory", 16 << 20)
    if tp > 1:
        llm, owned = ENGINES.get(model=path, tensor_parallel_size=tp, **kw), False
    else:
        ENGINES.close()  # a single-process engine resets the process's tensor-parallel group (one_engine.py)
        llm, owned = LLM(model=path, dtype="float32", **kw), True
    try:
        preempted = llm.get_stats().num_preemptions
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        stats = llm.get_stats()
        weights = llm.engine.core.executor.weight_bytes_per_rank
    finally:
        if owned:
            llm.engine.shutdown()
    assert stats.num_free_blocks == stats.num_total_blocks
    return outs, stats.num_preemptions - preempted, weights


def greedy(path, tp, prompts=PROMPTS, sp=SP, **kw):
    outs, preempted, weights = generate(path, tp, prompts, sp, **kw)
    return [o.outputs[0].token_ids for o in outs], preempted, weights


def test_tp2_idle_work_prefaults_every_rank_and_tokens_do_not_change(make_ckpt):
    """A server's idle core drives every rank's CPU KV cache prefault through the executor (a
    broadcast like a step's); it ends once all ranks are done, and the tokens stay those of TP=1."""
    path = make_ckpt("tp_llama", "llama", heads=4, kv_heads=2)
    llm = ENGINES.get(model=path, tensor_parallel_size=2, kv_cache_memory=16 << 20)
    executor = llm.engine.core.executor
    t0 = time.monotonic()
    while executor.idle_work(0.01):  # False only when no rank has any left
        assert time.monotonic() - t0 < 60, "the ranks' idle prefault did not finish"
    assert executor.worker.kv_idle_prefault.done
    assert not executor.idle_work(0.01)
    two, _, _ = greedy(path, 2)
    one, _, _ = greedy(path, 1)
    assert two == one


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1(make_ckpt, arch):
    path = make_ckpt(f"tp_{arch}", arch, heads=4, kv_heads=2)
    one, _, w1 = greedy(path, 1)
    two, _, w2 = greedy(path, 2)
    assert two == one
    assert len(w2) == 2 and all(abs(w - w1[0] / 2) / w1[0] < 0.02 for w in w2)


def test_tp2_logprobs_and_seeded_sampling_match_tp1(make_ckpt):
    """logprobs, prompt_logprobs (across prefill chunks), n>1 and seeded random sampling: rank 0
    samples and every rank keeps the same request state, so TP=2 reproduces TP=1."""
    path = make_ckpt("tp_llama", "llama", heads=4, kv_heads=2)
    prompts = random_prompts((5, 40, 90, 12), seed=13)
    sps = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=0),
        SamplingParams(temperature=1.0, top_k=40, seed=7, n=2, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True, prompt_logprobs=1),
    ]
    # the 32-token budget splits the 40- and 90-token prompts (and their prompt logprobs) into chunks
    one, _, _ = generate(path, 1, prompts, sps, max_num_batched_tokens=CHUNK)
    two, _, _ = generate(path, 2, prompts, sps, max_num_batched_tokens=CHUNK)
    assert [len(o.outputs) for o in two] == [1, 1, 2, 1]
    for o1, o2 in zip(one, two):
        _assert_logprobs_close(o1.prompt_logprobs, o2.prompt_logprobs)
        for c1, c2 in zip(o1.outputs, o2.outputs):
            assert c2.token_ids == c1.token_ids
            _assert_logprobs_close(c1.logprobs, c2.logprobs)
    assert one[1].prompt_logprobs is not None and one[3].prompt_logprobs is not None
    assert all(c.logprobs is not None for c in two[2].outputs)
    assert two[2].outputs[0].token_ids != two[2].outputs[1].token_ids  # n=2 samples differ


def test_dead_rank_fails_fast(make_ckpt):
    path = make_ckpt("tp_llama", "llama", heads=4, kv_heads=2)
    llm = ENGINES.get(model=path, tensor_parallel_size=2, max_num_batched_tokens=CHUNK)  # the test's above
    assert_killed_rank_fails_fast(llm, PROMPTS[:2], SP)


def test_tp2_under_preemption(make_ckpt):
    path = make_ckpt("tp_llama", "llama", heads=4, kv_heads=2)
    prompts = random_prompts((70, 70, 70, 70), seed=12)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    one, _, _ = greedy(path, 1, prompts, sp)
    # per rank: 1 kv head * 16 dims * 4 B * 2 * 2 layers = 256 B/token -> 20 blocks of 16 tokens:
    # all four 70-token prompts get in (5 blocks each), then growing past 80 tokens forces preemption
    two, preempted, _ = greedy(path, 2, prompts, sp, kv_cache_memory=256 * 16 * 20, max_model_len=200)
    assert preempted > 0
    assert two == one


def test_tp_replicates_kv_heads_when_fewer_than_ranks(make_ckpt):
    path = make_ckpt("tp_mqa", "llama", heads=4, kv_heads=1)
    one, _, _ = greedy(path, 1)
    two, _, _ = greedy(path, 2)
    assert two == one


def _assert_logprobs_close(a, b):
    """Two SampleLogprobs/PromptLogprobs lists: same token ids and ranks, values within tolerance."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        assert (pa is None) == (pb is None)
        if pa is None:
            continue
        assert list(pa) == list(pb)
        for tok in pa:
            assert pa[tok].rank == pb[tok].rank
            assert pa[tok].logprob == pytest.approx(pb[tok].logprob, abs=1e-4)


def test_bad_tp_size_is_a_clear_error(make_ckpt):
    path = make_ckpt("tp_heads6", "llama", heads=6, kv_heads=2, hidden=96)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(model=path, dtype="float32", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=path, dtype="float32", tensor_parallel_size=0)


def test_server_with_tensor_parallel_size_2(make_ckpt):
    import socket
    import subprocess
    import sys

    import httpx

    ENGINES.close()  # its ranks would share the cores with the server's
    path = make_ckpt("tp_llama", "llama", heads=4, kv_heads=2)
    ref_llm = LLM(model=path, dtype="float32", kv_cache_memory=16 << 20)
    ref = [o.outputs[0].text for o in ref_llm.generate(prompt_token_ids=PROMPTS[:2], use_tqdm=False,
                                                       sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", path, "--port", str(port),
                             "--tensor-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", str(16 << 20),
                             "--served-model-name", "tp"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "tp", "prompt": PROMPTS[:2], "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == ref and all(c["finish_reason"] == "length" for c in choices)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_tp2_gguf_shards_the_packed_rows(tmp_path):
    """A GGUF file's blocks are split between the ranks as they are (q/k/v and gate/up by rows,
    o and down by whole blocks of columns): TP=2 gives TP=1's tokens with about half the packed
    weights per rank; a split that would cut a k-quant block of 256 is refused naming the tensor."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    path = write_gguf(str(tmp_path / "tp-q4_0.gguf"), "Q4_0")
    prompts = [[5, 17, 33, 250, 100, 7], list(range(40, 90))]
    one, _, w1 = greedy(path, 1, prompts)
    two, _, w2 = greedy(path, 2, prompts)
    assert two == one
    assert max(w2) < 0.75 * w1[0]
    kq = write_gguf(str(tmp_path / "tp-q4_k.gguf"), "Q4_K")
    with pytest.raises(Exception, match="split a block of 256"):
        greedy(kq, 2, prompts)
