"""envs.py is the one place environment variables are read: every read in pagedllm/ (os.environ,
os.getenv) outside it is refused here, and every variable its table lists is read by its code."""
from __future__ import annotations

import ast
import os
import re

import pagedllm
from pagedllm import envs

PACKAGE = os.path.dirname(pagedllm.__file__)
ENVS = os.path.join(PACKAGE, "envs.py")


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def environment_reads(path: str) -> list[tuple[int, str]]:
    """(line, what) of each read of the environment in ``path``: os.getenv, os.environ.get/pop,
    os.environ[...] loads and ``... in os.environ``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                out.append((node.lineno, "os.getenv"))
            elif f.attr in ("get", "pop") and _is_environ(f.value):
                out.append((node.lineno, f"os.environ.{f.attr}"))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, "os.environ[...]"))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            out.append((node.lineno, "in os.environ"))
    return out


def test_the_environment_is_read_in_envs_py_only():
    stray = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != ENVS:
                stray += [f"{os.path.relpath(path, PACKAGE)}:{line}: {what}" for line, what in environment_reads(path)]
    assert not stray, "read these through pagedllm/envs.py (and list them in its table):\n" + "\n".join(stray)


def test_every_variable_in_the_table_is_read_by_envs_py():
    doc = envs.__doc__
    table = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| variable")]
    listed = {v for line in table for v in re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", line.split("|")[1])}
    with open(ENVS, encoding="utf-8") as f:
        code = f.read().split('"""', 2)[2]  # below the docstring
    unread = sorted(v for v in listed if f'"{v}"' not in code and v not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    assert not unread, f"listed in envs.py's table but not read there: {unread}"
    read = set(re.findall(r'_get\("([A-Z0-9_]+)"\)', code)) | set(re.findall(r'= "([A-Z][A-Z0-9_]+)"', code))
    assert read <= listed, f"read by envs.py but not in its table: {sorted(read - listed)}"
