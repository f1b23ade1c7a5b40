"""How one constraint (its cache key: kind and text) becomes an xgrammar CompiledGrammar, on
whatever GrammarCompiler is given: the engine's (structured_output/backend.py) or a compile
worker's (structured_output/compile_process.py). Compile errors become ValueErrors naming the
field (``structured_outputs.json`` ...)."""
from __future__ import annotations

import json
import re

_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: (Check failed: \(.*?\) is false: )?")


def _choice_grammar(choices: list[str]) -> str:
    """EBNF ``root ::= "a" | "b"`` with each choice as an escaped literal (JSON's escapes are
    the EBNF parser's: \\", \\\\, \\n, \\uXXXX)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def _clean(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0] if lines else type(e).__name__)


def compile_with(compiler, key: tuple[str, str]):
    """``key``'s CompiledGrammar from an xgrammar GrammarCompiler (here, or in a compile worker
    process); ValueError naming the field when it does not compile."""
    kind, text = key
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":  # any object; strict_mode off so it may hold any properties
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(text)))
        if kind == "structural_tag":
            return _structural_tag(compiler, json.loads(text))
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar (EBNF)",
                "choice": "choice list", "json_object": "JSON object grammar", "structural_tag": "structural tag"}[kind]
        raise ValueError(f"structured_outputs.{kind}: the {what} could not be compiled: {_clean(e)}") from None


def _structural_tag(compiler, tag: dict):
    """vLLM's shape (``structures`` of begin / schema / end, and ``triggers``) or xgrammar's
    newer one (``format``), which xgrammar reads itself."""
    if "structures" not in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    import xgrammar as xgr

    unknown = sorted(set(tag) - {"structures", "triggers"})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (structures, triggers)")
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a non-empty list of strings")
    items = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] needs begin and end strings")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]))
    return compiler.compile_structural_tag(items, triggers)
