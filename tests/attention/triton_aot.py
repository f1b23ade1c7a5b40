"""The tail shared by the Triton files' ahead-of-time compile checks (test_triton_attn.py,
test_triton_kv8.py): each check's script records the kernels' launches (``calls`` of
(kernel, args, kwargs), ``TY`` naming tensor dtypes) as the engine makes them, then this compiles
every distinct signature for sm_90 with no GPU and prints AOT-OK; ``AotRun`` runs such a script
in a fresh process (compiled mode, its own Triton cache) and checks it got there.

The compile is single-threaded and needs nothing from the test process, so the ``aot_compile``
fixture (autouse, imported by both files) starts it when the module's first test runs, beside the interpreted
tests (on two cores it takes the one they leave idle); the compile test then only waits for it."""
import os
import subprocess
import sys

import pytest

COMPILE_RECORDED_CALLS = r"""
seen = set()
for fn, args, kw in calls:
    kw = dict(kw)
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    sig, consts, attrs = {}, {}, {}
    bound = dict(zip(fn.arg_names, args)); bound.update(kw)
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"; consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TY[v.dtype]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif isinstance(v, int) and v == 1:
            sig[p.name] = "constexpr"; consts[p.name] = 1
        else:
            sig[p.name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn.fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items())), repr(opts))
    if key in seen:
        continue
    seen.add(key)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    assert k.asm["cubin"], key
    print("compiled", fn.fn.__name__, {c: consts[c] for c in consts if c.isupper()}, "shared", k.metadata.shared, flush=True)
print("AOT-OK", len(seen))
"""


def _backend_missing():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler as _nv  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"triton NVIDIA backend unavailable: {e}"
    return None


class AotRun:
    """One compile script running in a fresh process; ``check()`` waits for it and asserts it
    compiled everything (``AOT-OK``)."""

    def __init__(self, tmp_path, script_text: str) -> None:
        script = tmp_path / "aot.py"
        script.write_text(script_text)
        env = dict(os.environ)
        env.pop("PAGEDLLM_TRITON_NATIVE", None)
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"  # files: nobody reads pipes meanwhile
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=out, stderr=err)

    def check(self, timeout: float = 600) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        out, err = self.out.read_text(), self.err.read_text()
        assert self.proc.returncode == 0 and "AOT-OK" in out, out[-3000:] + err[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def aot_compile(request, tmp_path_factory):
    """Imported by a test module with an ``_AOT_SCRIPT`` and a test_compiles_for_sm90_without_gpu:
    its compile started with the module's first test (if that test was collected and Triton's
    NVIDIA backend is there; None otherwise), stopped at the module's end if still running."""
    wanted = any(getattr(item, "module", None) is request.module and item.name == "test_compiles_for_sm90_without_gpu"
                 for item in request.session.items)
    run = AotRun(tmp_path_factory.mktemp("aot"), request.module._AOT_SCRIPT) if wanted and not _backend_missing() else None
    yield run
    if run is not None:
        run.stop()


def check_background_aot(run) -> None:
    """The compile test's body: wait for the background compile (skip without the backend)."""
    missing = _backend_missing()
    if missing:
        pytest.skip(missing)
    assert run is not None, "the background compile did not start"
    run.check()
