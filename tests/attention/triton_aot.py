"""The tail shared by the Triton files' ahead-of-time compile checks (test_triton_attn.py,
test_triton_kv8.py): each check's script records the kernels' launches (``calls`` of
(kernel, args, kwargs), ``TY`` naming tensor dtypes) as the engine makes them, then this compiles
every distinct signature for sm_90 with no GPU and prints AOT-OK; ``run_aot_script`` runs such a
script in a fresh process (compiled mode, its own Triton cache) and checks it got there."""
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


def run_aot_script(tmp_path, script_text: str) -> None:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler as _nv  # noqa: F401
    except Exception as e:  # pragma: no cover
        pytest.skip(f"triton NVIDIA backend unavailable: {e}")
    script = tmp_path / "aot.py"
    script.write_text(script_text)
    env = dict(os.environ)
    env.pop("PAGEDLLM_TRITON_NATIVE", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
