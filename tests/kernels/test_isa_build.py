"""The CPU kernels' build and loading framework (pagedllm/kernels: isa.py, build.py, cpu.py):
the level is chosen from the CPU's flags (faked here), a build cached under another level's key
is never imported, failed builds are remembered, and a level this CPU can run gives the same
results as the one it loads by default."""
from __future__ import annotations

import logging
import os
import stat
import time
from types import SimpleNamespace

import pytest
import torch

from pagedllm.kernels import build, cpu, isa

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}

x86 = pytest.mark.skipif(not isa.is_x86(), reason="the avx2/avx512/amx levels are x86-64's")


def needs_compiler():
    comp = build.compiler()
    if comp is None:
        pytest.skip("no C++ compiler")
    return comp


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(flags): the loader sees a CPU with these /proc/cpuinfo flags."""
    return lambda flags: monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags))


@pytest.fixture
def recorder(monkeypatch):
    """build.build and cpu._import replaced: a "build" is a file named like the real one (after
    the real compiler probe), an "import" records which level and file it was asked for."""
    calls = SimpleNamespace(built=[], imported=[])

    def fake_build(cache_dir, level, comp, jobs=None):
        if build.supports(comp, level) is not None:
            raise build.BuildError(f"{comp.description} does not compile {level.name}")
        calls.built.append(level.name)
        path = os.path.join(build.key_dir(cache_dir, level), comp.tag + ".so")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(level.name)
        return path

    def fake_import(path, level):
        with open(path) as f:
            assert f.read() == level.name, f"imported {path} as {level.name}"
        calls.imported.append((level.name, path))
        return SimpleNamespace(isa=level.name)

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(cpu, "_import", fake_import)
    return calls


@x86
@pytest.mark.parametrize("flags, expected", [
    (frozenset(), "scalar"),
    (AVX2 - {"f16c"}, "scalar"),
    (AVX2, "avx2"),
    (AVX2 | {"avx512f", "avx512_bf16"}, "avx2"),  # AVX-512 F alone is not x86-64-v4
    (AVX512, "avx512"),
    (AVX512_BF16, "avx512_bf16"),
    (AMX, "amx"),
])
def test_best_level_from_cpu_flags(flags, expected):
    assert isa.best(flags).name == expected
    assert [lvl.name for lvl in isa.runnable(flags)][-1] == "scalar"


def test_flags_from_torch_where_proc_cpuinfo_is_missing(monkeypatch):
    monkeypatch.setattr(isa, "_cpuinfo", lambda: {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert isa.cpu_flags.__wrapped__() == AVX2


@x86
@pytest.mark.parametrize("flags, expected", [(AVX2, ["avx2"]), (AVX512_BF16, ["avx512_bf16"])])
def test_loader_builds_the_best_level(tmp_path, fake_cpu, recorder, flags, expected):
    needs_compiler()
    fake_cpu(flags)
    assert cpu.select_and_load(str(tmp_path)).isa == expected[0]
    assert recorder.built == expected
    assert cpu.select_and_load(str(tmp_path)).isa == expected[0]  # cached: not built again
    assert recorder.built == expected


@x86
def test_amx_cpu_builds_amx_if_the_compiler_supports_it(tmp_path, fake_cpu, recorder):
    comp = needs_compiler()
    fake_cpu(AMX)
    expected = "amx" if build.supports(comp, isa.level("amx")) is None else "avx512_bf16"
    assert cpu.select_and_load(str(tmp_path)).isa == expected


@x86
def test_build_for_another_level_is_never_loaded(tmp_path, fake_cpu, recorder, monkeypatch):
    comp = needs_compiler()
    for name in ("avx512", "avx512_bf16", "amx"):  # planted: builds for CPUs with more than AVX2
        d = build.key_dir(str(tmp_path), isa.level(name))
        os.makedirs(d)
        for file in (comp.tag + ".so", "other-compiler.so"):
            with open(os.path.join(d, file), "w") as f:
                f.write("planted")
    fake_cpu(AVX2)
    assert cpu.select_and_load(str(tmp_path)).isa == "avx2"
    assert recorder.built == ["avx2"]
    monkeypatch.setattr(build, "_compilers", {build.envs.cxx(): None})  # no compiler: any cached build
    assert cpu.select_and_load(str(tmp_path)).isa == "avx2"  # ... but only of a level this CPU runs
    assert [name for name, _ in recorder.imported] == ["avx2", "avx2"]
    assert all("planted" not in open(path).read() for _, path in recorder.imported)


def test_forced_level_this_cpu_lacks_is_refused(tmp_path, fake_cpu, capsys):
    fake_cpu(AVX2 if isa.is_x86() else ())
    assert cpu.main(["--isa", "avx512_bf16", "--cache-dir", str(tmp_path)]) == 2
    assert "cannot run the avx512_bf16 kernels" in capsys.readouterr().err
    with pytest.raises(ValueError, match="avx512f" if isa.is_x86() else "x86-64"):
        cpu.select_and_load(str(tmp_path), level="avx512_bf16")
    assert not os.listdir(tmp_path)  # nothing was built


FAKE_CXX = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in
  *--version*) echo "fakecc 1.0"; exit 0 ;;
  *"-x c++"*) exit 0 ;;  # the compiler probe: accepts every level
esac
echo "error: boom" >&2
exit 1
"""


def test_failed_build_is_remembered(tmp_path, fake_cpu, monkeypatch, caplog):
    log = tmp_path / "invocations"
    cxx = tmp_path / "fakecc"
    cxx.write_text(FAKE_CXX.format(log=log))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setattr(build, "_compilers", {})
    monkeypatch.setattr(build, "_probes", {})
    fake_cpu(AVX2 if isa.is_x86() else ())
    cache = str(tmp_path / "cache")

    assert cpu.select_and_load(cache) is None  # avx2, then scalar: both fail
    comp = build.compiler()
    levels = [lvl for lvl in isa.runnable()]
    for lvl in levels:
        assert "boom" in build.failure(cache, lvl, comp)
    assert any("-c" in line.split() for line in log.read_text().splitlines())

    monkeypatch.setattr(build, "_compilers", {})  # as a new process would start
    monkeypatch.setattr(build, "_probes", {})
    log.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.kernels.cpu"):
        assert cpu.select_and_load(cache) is None
        assert cpu.select_and_load(cache) is None
    assert log.read_text().split() == ["--version"]  # identified, never asked to build
    skipped = [r.getMessage() for r in caplog.records if "skipped, it failed before" in r.getMessage()]
    assert len(skipped) == len(levels)  # one warning per failed key, not one per load

    assert cpu.select_and_load(cache, retry_failed=True) is None  # what `python -m ...cpu` does
    assert any("-c" in line.split() for line in log.read_text().splitlines())


def test_describe_names_level_cpu_and_flags():
    info = cpu.describe()
    assert info["isa_cpu_best"] in isa.NAMES
    assert info["kernels"] in ("loaded", "unavailable", "not loaded")
    assert set(info["cpu_flags"]) <= isa.cpu_flags()
    assert isinstance(info["cpu_model"], str) and info["cpu_model"]
    if info["isa"] is not None:
        assert info["isa_flags"] == list(isa.level(info["isa"]).cxx_flags)


def _same_results(a, b):
    """The ops of two builds agree (float32 arithmetic in both; only the instructions differ)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g)
    w = torch.rand(96, generator=g) + 0.5
    outs = [torch.empty_like(x) for _ in range(2)]
    for m, out in zip((a, b), outs):
        m.rms_norm(out, x, w, 1e-6)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)

    gate_up = torch.randn(5, 2 * 40, generator=g, dtype=torch.float32).to(torch.bfloat16)
    outs = [torch.empty(5, 40, dtype=torch.bfloat16) for _ in range(2)]
    for m, out in zip((a, b), outs):
        m.silu_and_mul(out, gate_up)
    torch.testing.assert_close(outs[0], outs[1])

    n, k = 40, 72  # float32 weights are packed the same way for every level: [ceil(N/16), K, 16]
    weight = torch.randn(n, k, generator=g)
    panels = torch.nn.functional.pad(weight, (0, 0, 0, 48 - n)).reshape(3, 16, k).transpose(1, 2).contiguous()
    xs = torch.randn(9, k, generator=g)
    ys = [m.packed_linear(xs, panels, n) for m in (a, b)]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys[0], xs @ weight.t(), rtol=1e-4, atol=1e-4)

    for dtype in (torch.float32, torch.bfloat16):  # decode attention over a paged cache
        B, H, Hkv, D, bs, blocks = 3, 4, 2, 32, 8, 6
        q = torch.randn(B, H, D, generator=g).to(dtype)
        kc = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
        vc = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
        table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
        lens = torch.tensor([5, 16, 11], dtype=torch.int32)
        outs = [torch.empty(B, H, D, dtype=dtype) for _ in range(2)]
        for m, out in zip((a, b), outs):
            m.paged_decode_attention(out, q, kc, vc, table, lens, D ** -0.5, 0)
        torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "scalar"])
def test_lower_level_builds_and_matches_the_loaded_one(tmp_path, kernels, fake_cpu, level):
    """A real build of a lower level than this CPU's (what an AVX2-only or non-x86 machine
    loads), with a planted build of every higher level it must not import."""
    lacking = isa.missing(isa.level(level))
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(lacking)}")
    if level == kernels.isa:  # building it again would compare a build with itself (a minute on 2 cores)
        pytest.skip(f"{level} is this CPU's own level: the loaded build is that build")
    needs_compiler()
    for higher in isa.LEVELS[isa.NAMES.index(level) + 1:]:
        d = build.key_dir(str(tmp_path), higher)
        os.makedirs(d)
        with open(os.path.join(d, build.compiler().tag + ".so"), "w") as f:
            f.write("planted: importing this fails")
    fake_cpu(isa.level(level).cpu_flags)
    module = cpu.select_and_load(str(tmp_path))
    assert module.isa == level
    assert "avx512f" not in module.compiled_features
    assert ("avx2" in module.compiled_features) == (level == "avx2")
    print(f"compared {level} ({module.compiled_features}) with {kernels.isa} ({kernels.compiled_features})")
    _same_results(module, kernels)


def test_builders_of_one_key_take_turns(tmp_path, monkeypatch):
    """A process that waited for another's build of the same key loads it instead of compiling
    the sources again; a remembered failure of that build is raised, not retried."""
    import threading

    comp = build.Compiler(("c++",), "/usr/bin/c++", "fake 1.0")
    level = isa.level("avx2")
    d = build.key_dir(str(tmp_path), level)
    os.makedirs(d)
    target = os.path.join(d, comp.tag + ".so")
    compiled = []
    monkeypatch.setattr(build, "_build_locked", lambda *a: compiled.append(1) or target)
    holding, results = threading.Event(), []

    def other_builder():
        with build._turn(os.path.join(d, comp.tag + ".lock")) as waited:
            assert not waited
            holding.set()
            time.sleep(0.5)
            with open(target, "w") as f:
                f.write("built by the other")

    t = threading.Thread(target=other_builder)
    t.start()
    holding.wait()
    results.append(build.build(str(tmp_path), level, comp))
    t.join()
    assert results == [target] and compiled == []  # waited, then took the other's build
    assert build.build(str(tmp_path), level, comp) == target and compiled == [1]  # no one waiting: builds

    os.unlink(target)
    build._write_atomic(build.failure_path(str(tmp_path), level, comp), "building avx2 failed\ntail\n")
    with build._turn(os.path.join(d, comp.tag + ".lock")):
        waiter = []
        w = threading.Thread(target=lambda: waiter.append(pytest.raises(build.BuildError, build.build, str(tmp_path),
                                                                        level, comp)))
        w.start()
        time.sleep(0.5)
    w.join()
    assert "building avx2 failed" in str(waiter[0].value) and compiled == [1]


def test_a_builder_gives_up_waiting(tmp_path):
    lock = str(tmp_path / "x.lock")
    with build._turn(lock) as first:
        t0 = time.monotonic()
        with build._turn(lock, timeout_s=0.3) as second:
            assert not first and second and time.monotonic() - t0 >= 0.3
