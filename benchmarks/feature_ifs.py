"""Issue 47's structural counts, reproducibly: the ``if`` / ``elif`` statements of engine/core.py,
core/scheduler.py and worker/model_runner.py whose test names an optional feature (a name or
attribute from FEATURE_NAMES below), and the functions in core/, engine/, worker/ and executor/
longer than 60 lines (the ``def`` line to the last line of its body).

A test "names a feature" when a Name, an Attribute's attr or a string constant in it is one of
FEATURE_NAMES (conditional expressions ``a if c else b`` are not statements and are not
counted). The list is explicit so the count can be argued about line by line (``--list`` prints
each if that counts).

    python benchmarks/feature_ifs.py [--list]
"""
from __future__ import annotations

import argparse
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "pagedllm")
FILES = ("engine/core.py", "core/scheduler.py", "worker/model_runner.py")
ROOMS = ("core", "engine", "worker", "executor")
MAX_LINES = 60

FEATURE_NAMES = frozenset({
    # async scheduling, pipeline parallelism, batches in flight
    "async_scheduling", "batch_depth", "max_batches_in_flight", "pipeline_parallel_size", "_pipeline",
    "send_new_token_ids", "new_token_ids", "num_pending", "in_flight",
    # beam search, n > 1 / best_of
    "beam", "beams", "beam_groups", "num_children", "parent_id",
    # structured outputs
    "structured", "structured_outputs", "grammars", "grammar", "matchers", "tokenizer",
    # LoRA
    "lora", "lora_slots", "enable_lora", "lora_loads", "max_loras",
    # speculative decoding
    "spec", "drafts", "look_ahead", "num_spec_slots", "speculative_config", "num_spec_tokens",
    # the KV offload tier
    "tier", "kv_tier", "kv_tier_spec", "kv_transfers",
    # multimodal
    "mm_features", "encoder_cache",
    # deadlines, priorities
    "deadline", "deadlines", "priority",
    # distributed executors
    "ray", "distributed_executor_backend", "tensor_parallel_size",
    # scheduling knobs, logprobs, sliding windows
    "long_prefill_token_threshold", "prompt_logprobs", "_num_prompt_logprob_rows", "sliding_window",
    "_bulk_decode",
})


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def _parse(rel: str) -> ast.Module:
    with open(os.path.join(ROOT, rel)) as f:
        return ast.parse(f.read(), rel)


def feature_ifs(rel: str) -> list[tuple[int, str, list[str]]]:
    """(line, function, the feature names) of each if/elif in ``rel`` whose test names a feature."""
    tree, found = _parse(rel), []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.If):
                hits = sorted(_names(child.test) & FEATURE_NAMES)
                if hits:
                    found.append((child.lineno, func, hits))
            visit(child, name)

    visit(tree, "<module>")
    return found


def long_functions(limit: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(file, qualified name, lines) of each function over ``limit`` lines in ROOMS."""
    out = []
    for room in ROOMS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, room)):
            for fn in sorted(files):
                if not fn.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, fn), ROOT)
                out.extend((rel, name, n) for name, n in _functions(_parse(rel)) if n > limit)
    return sorted(out)


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print each feature-testing if")
    args = ap.parse_args()
    total = 0
    print(f"{'file':<28} feature ifs")
    for rel in FILES:
        found = feature_ifs(rel)
        total += len(found)
        print(f"{rel:<28} {len(found):>4}")
        if args.list:
            for line, func, hits in found:
                print(f"    {line:>4} {func:<28} {', '.join(hits)}")
    print(f"{'total':<28} {total:>4}")
    longs = long_functions()
    print(f"\nfunctions over {MAX_LINES} lines in {', '.join(ROOMS)}: {len(longs)}")
    for rel, name, n in longs:
        print(f"    {rel}:{name} {n}")


if __name__ == "__main__":
    main()
