"""How much of the core loops is feature plumbing: feature-specific conditionals and function lengths, by AST.

A conditional is the test of an ``if``/``elif``, a ternary, a ``while``, a comprehension's ``if``
or an operand of a boolean ``and``/``or`` used as one of those tests. It is feature-specific when
an identifier or attribute in it names a feature (its underscore-separated words include one of
FEATURES' words). Function length: lines from ``def`` to the last line of the body.

    python scripts/feature_conditionals.py [--json out.json] [--over 60]

Issue 32 takes this count before and after its redesign (the same script, the same words).
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent / "pagedllm"
COUNTED = ("core/scheduler.py", "worker/model_runner.py", "engine/core.py")
LENGTH_ROOMS = ("core", "engine", "worker")
FEATURES = {
    "spec": {"spec", "draft", "drafts", "speculate", "governor", "gov", "accepted", "verify"},
    "lora": {"lora", "loras", "adapter", "adapters"},
    "beam": {"beam", "beams", "cow", "copies"},
    "pp": {"pp", "pipeline", "pipelined", "flight", "stage", "batch_reqs"},
    "tp": {"tp", "world", "sampler", "broadcast"},
    "structured": {"grammar", "structured", "bitmask", "matchers", "compiling"},
    "graphs": {"graph", "graphs"},
}
_WORD = re.compile(r"[A-Za-z][a-z0-9]*|[A-Z]+(?![a-z])")


def _words(node: ast.AST) -> set[str]:
    words: set[str] = set()
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.isidentifier():
            name = sub.value  # getattr(x, "spec", None)
        if name:
            parts = [p.lower() for p in name.split("_") if p]
            words.update(parts)
            words.update(f"{a}_{b}" for a, b in zip(parts, parts[1:]))
    return words


def _tests(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def count_conditionals(path: pathlib.Path) -> dict:
    tree = ast.parse(path.read_text())
    total, feature_total, by_feature = 0, 0, Counter()
    for test in _tests(tree):
        operands = test.values if isinstance(test, ast.BoolOp) else [test]
        for op in operands:
            total += 1
            hit = [f for f, ws in FEATURES.items() if _words(op) & ws]
            if hit:
                feature_total += 1
                by_feature.update(hit)
    return {"conditionals": total, "feature_specific": feature_total, "by_feature": dict(sorted(by_feature.items()))}


def function_lengths(path: pathlib.Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--over", type=int, default=60, help="list functions longer than this")
    args = ap.parse_args()
    conds = {rel: count_conditionals(ROOT / rel) for rel in COUNTED}
    print(f"{'file':28s} {'conditionals':>12s} {'feature':>8s}  by feature")
    for rel, c in conds.items():
        print(f"{rel:28s} {c['conditionals']:12d} {c['feature_specific']:8d}  {c['by_feature']}")
    tot = sum(c["feature_specific"] for c in conds.values())
    print(f"{'total':28s} {sum(c['conditionals'] for c in conds.values()):12d} {tot:8d}")
    long_fns, named = [], {}
    for room in LENGTH_ROOMS:
        for path in sorted((ROOT / room).glob("*.py")):
            for name, n in function_lengths(path):
                rel = f"{room}/{path.name}"
                if name in ("Scheduler.schedule", "ModelRunner.execute", "EngineCore.step"):
                    named[f"{rel}:{name}"] = n
                if n > args.over:
                    long_fns.append((f"{rel}:{name}", n))
    print("\nnamed functions:", ", ".join(f"{k} {v}" for k, v in named.items()))
    print(f"functions over {args.over} lines in {', '.join(LENGTH_ROOMS)}:")
    for name, n in sorted(long_fns, key=lambda x: -x[1]):
        print(f"  {n:4d}  {name}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"conditionals": conds, "named": named, "over": dict(long_fns)}, indent=1))


if __name__ == "__main__":
    main()
