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
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar (EBNF)",
                "choice": "choice list", "json_object": "JSON object grammar"}[kind]
        raise ValueError(f"structured_outputs.{kind}: the {what} could not be compiled: {_clean(e)}") from None
