"""Imports point inward, and nothing forms a cycle -- read statically from the source, so imports
inside functions (the usual way a cycle hides) count as much as those at the top of a file.

One table of room ranks, highest first. A room imports only rooms of lower rank (and itself);
the next import that points outward or closes a cycle fails CI, naming the file and line.
"""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pagedllm"

# Highest first. Rooms on one line share a rank and must not import one another.
RANKS = [
    ["__init__"],  # the package's public face: lazily re-exports LLM, AsyncLLM, ...
    ["entrypoints"],
    ["bench"],  # `pagedllm bench`: the CLI hands it the engine-flag helpers and the LLM it drives
    ["engine"],
    ["executor"],
    ["worker"],
    ["spec_decode"],  # proposers may run a draft model
    ["models"],
    ["lora"],  # wraps the layers' linear modules with batched adapter deltas
    ["layers", "structured_output"],
    ["quantization"],  # linear layers ask their quantization method for weights and matmul
    ["attention", "sample"],
    ["kernels", "distributed", "tokenizer", "metrics", "multimodal"],
    ["core"],
    ["config", "sampling_params", "outputs", "inputs"],
    ["envs", "version", "heap"],  # heap: glibc malloc_trim, imports nothing of ours
]
RANK = {room: len(RANKS) - i for i, rooms in enumerate(RANKS) for room in rooms}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def resolve(name: str) -> str:
    """``pagedllm.x.y`` -> the module it names (a submodule if one exists, else its package)."""
    parts = name.split(".")
    while parts:
        base = PACKAGE.parent.joinpath(*parts)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return name


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every pagedllm module ``path`` imports (anywhere in the file) with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), node.lineno) for a in node.names if a.name.split(".")[0] == "pagedllm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "pagedllm":
                continue
            for alias in node.names:  # `from pagedllm.kernels import cpu` imports a submodule
                found.append((resolve(f"{mod}.{alias.name}"), node.lineno))
    return [(m, line) for m, line in found if m != me]


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_room_has_a_rank():
    rooms = {room_of(m) for m in graph()}
    assert rooms <= set(RANK), f"rooms missing from RANKS: {sorted(rooms - set(RANK))}"


def test_imports_point_inward():
    bad = []
    for mod, deps in graph().items():
        src = room_of(mod)
        for dep, line in deps:
            dst = room_of(dep)
            if dst == src:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{mod}:{line} imports {dep} ({src} -> {dst})")
    assert not bad, "imports pointing outward or sideways:\n" + "\n".join(bad)


def test_core_imports_only_config_and_sampling_params():
    allowed = {"core", "config", "sampling_params", "envs"}
    bad = [f"{mod}:{line} imports {dep}" for mod, deps in graph().items() if room_of(mod) == "core"
           for dep, line in deps if room_of(dep) not in allowed]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = {m: sorted({d for d, _ in deps if d in graph()}) for m, deps in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    # The package's own __init__ re-exports lazily; a submodule naming `pagedllm` itself is the
    # only edge into it, which is not a cycle of real modules.
    cycles = [c for c in cycles if c != ["pagedllm"]]
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("source, expected", [
    ("from pagedllm.engine.core import EngineCore", "pagedllm.engine.core"),
    ("from pagedllm.kernels import cpu", "pagedllm.kernels.cpu"),
    ("import pagedllm.core.scheduler", "pagedllm.core.scheduler"),
    ("from .block_pool import BlockPool", "pagedllm.core.block_pool"),
])
def test_the_reader_finds_imports_inside_functions(monkeypatch, source, expected):
    fake = PACKAGE / "core" / "request.py"  # read a fake body as if it lived there (relative imports)
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: f"def f():\n    {source}\n")
    assert [m for m, _ in imports_of(fake)] == [expected]
