"""Per-shape choice between pagedllm's packed GEMM and oneDNN's (layers/gemm_select.py): the rule
(geometric mean of oneDNN's speed-ups at 1 / 64 / 512 rows above MARGIN), the on-disk cache (a
shape timed once per machine; a busy machine's timing never cached), the forced modes, and both
forms giving HF's greedy tokens through the engine."""
import json
import os

import pytest
import torch

from pagedllm.layers import gemm_select as gs

REAL_MACHINE_BUSY = gs.machine_busy  # before the autouse fixture stubs it


class FakeGemm:
    """Forms are tags; ``linear`` advances a fake clock by the table's seconds for (form, rows),
    with optional extra delays per call to fake a busy machine."""

    def __init__(self, table, jitter=()):
        self.table, self.jitter, self.now, self.calls = table, list(jitter), 0.0, 0

    def clock(self):
        return self.now

    def ours(self, w):
        return ("pagedllm", tuple(w.shape))

    def onednn(self, w):
        return ("onednn", tuple(w.shape))

    def linear(self, x, form):
        self.calls += 1
        self.now += self.table[form[0]][x.shape[0]] + (self.jitter.pop(0) if self.jitter else 0.0)


def table(ours, onednn):
    return {"pagedllm": dict(zip(gs.ROWS, ours)), "onednn": dict(zip(gs.ROWS, onednn))}


@pytest.fixture(autouse=True)
def fresh_process_memo(monkeypatch):
    monkeypatch.setattr(gs, "_decided", {})
    monkeypatch.setattr(gs, "machine_busy", lambda: False)  # the test host's load is not the subject


def select(fake, shapes, tmp_path, mode="auto"):
    return gs.select_forms(shapes, torch.float32, mode, str(tmp_path), "test-level", fake.ours, fake.onednn,
                           fake.linear, fake.clock)


@pytest.mark.parametrize("ours,onednn,choice", [
    ((1.0, 4.0, 30.0), (1.1, 4.0, 28.0), "pagedllm"),   # ours 10% ahead at 1 row, oneDNN 7% at 512: even
    ((1.0, 4.0, 30.0), (1.0, 2.0, 8.0), "onednn"),      # tiles-like wins at batch sizes
    ((1.0, 4.0, 30.0), (0.96, 3.9, 29.0), "pagedllm"),  # 3% ahead everywhere: within the margin
])
def test_rule_geometric_mean_over_row_counts(ours, onednn, choice):
    fake = FakeGemm(table(ours, onednn))
    t = gs.time_shape(8, 16, torch.float32, fake.ours, fake.onednn, fake.linear, fake.clock)
    assert t.pagedllm_s == pytest.approx(ours) and t.onednn_s == pytest.approx(onednn) and not t.noisy
    assert t.choice == choice


def test_choices_are_cached_per_machine_and_reused(tmp_path):
    fake = FakeGemm(table((1.0, 4.0, 30.0), (1.0, 2.0, 8.0)))
    shapes = [(8, 16), (24, 16), (8, 16)]
    assert select(fake, shapes, tmp_path) == {(8, 16): "onednn", (24, 16): "onednn"}
    (cache_file,) = (tmp_path / "gemm_select").iterdir()
    stored = json.loads(cache_file.read_text())
    assert set(stored) == {"8x16", "24x16"} and stored["8x16"]["onednn_speedup"] > 1.9
    gs._decided.clear()  # a new process: the file answers, nothing is timed
    calls = fake.calls
    assert select(fake, [(8, 16)], tmp_path) == {(8, 16): "onednn"} and fake.calls == calls
    assert select(fake, [(8, 16)], tmp_path, mode="pagedllm") == {(8, 16): "pagedllm"}


def test_a_busy_machine_is_not_remembered(tmp_path):
    # per row count: warm-ups and the first round clean, the other rounds slowed: the spread says "busy"
    jitter = ([0.0] * 4 + [5.0] * 2 * (gs.ROUNDS - 1)) * len(gs.ROWS)
    fake = FakeGemm(table((1.0, 4.0, 30.0), (1.1, 4.0, 28.0)), jitter)
    assert select(fake, [(8, 16)], tmp_path) == {(8, 16): "pagedllm"}
    assert not (tmp_path / "gemm_select").exists() or not any((tmp_path / "gemm_select").iterdir())
    calls = fake.calls
    assert select(fake, [(8, 16)], tmp_path) == {(8, 16): "pagedllm"} and fake.calls == calls  # same process
    gs._decided.clear()
    select(fake, [(8, 16)], tmp_path)
    assert fake.calls > calls  # the next process times it again


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match="cpu_gemm"):
        gs.select_forms([(8, 16)], torch.float32, "mkl", None, "x", None, None, None)
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(model="x", cpu_gemm="fastest")


def test_env_sets_the_default(monkeypatch):
    from pagedllm import envs

    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "onednn")
    assert envs.cpu_gemm() == "onednn"
    monkeypatch.delenv("PAGEDLLM_CPU_GEMM")
    assert envs.cpu_gemm() == "auto"


def test_real_timing_of_both_forms_on_this_cpu(tmp_path):
    """The real packers and linear: every cell timed, a choice made, and both forms compute the
    same product (within float32 rounding)."""
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.layers.cpu_gemm import linear, pack_panels, pack_weight, packing_available

    kernels = cpu_kernels.load()
    if kernels is None or not packing_available():
        pytest.skip("needs the C++ kernels and oneDNN packing")
    w = torch.randn(48, 64)
    x = torch.randn(5, 64)
    torch.testing.assert_close(linear(x, pack_panels(w, kernels)), linear(x, pack_weight(w, torch.float32)),
                               rtol=1e-5, atol=1e-5)
    t = gs.time_shape(48, 64, torch.float32, lambda v: pack_panels(v, kernels),
                      lambda v: pack_weight(v, torch.float32), linear)
    assert all(s > 0 for s in t.pagedllm_s + t.onednn_s) and t.choice in ("pagedllm", "onednn")


@pytest.mark.parametrize("mode", ["onednn", "auto"])
def test_engine_greedy_matches_hf_with_each_form(make_ckpt, tmp_path, mode):
    from checkpoints import assert_greedy_agrees, hf_greedy
    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels import cpu as cpu_kernels
    from pagedllm.layers.cpu_gemm import packing_available
    from prompts import random_prompts

    if cpu_kernels.load() is None or not packing_available():
        pytest.skip("needs the C++ kernels and oneDNN packing")
    path = make_ckpt("gemm_select_llama")
    prompts = random_prompts((5, 30), seed=2)
    llm = LLM(model=path, dtype="float32", kv_cache_memory=8 << 20, cpu_gemm=mode,
              kernel_cache_dir=os.path.join(str(tmp_path), "kernels") if mode == "auto" else None)
    worker = llm.engine.core.executor.worker
    forms = worker.cpu_description["gemm_forms"]
    if mode == "onednn":
        assert forms["onednn"] > 0 and forms["pagedllm"] == 0, forms
    assert worker.cpu_description["gemm_mode"] == mode
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                 ignore_eos=True), use_tqdm=False)
    assert_greedy_agrees(outs, hf_greedy(path, prompts, 8))
    llm.engine.shutdown()


def test_nothing_is_cached_while_the_load_is_above_the_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(gs, "machine_busy", lambda: True)
    fake = FakeGemm(table((1.0, 4.0, 30.0), (1.0, 2.0, 8.0)))
    assert select(fake, [(8, 16)], tmp_path) == {(8, 16): "onednn"}
    assert not (tmp_path / "gemm_select").exists()


def test_machine_busy_reads_the_load_against_the_allowed_cpus(monkeypatch):
    real = REAL_MACHINE_BUSY
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus + 0.5, 0.0, 0.0))
    assert real()
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus - 0.5, 0.0, 0.0))
    assert not real()
