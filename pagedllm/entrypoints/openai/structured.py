"""A request's output constraint, from whichever field carries it: OpenAI's ``response_format``
(``text`` / ``json_object`` / ``json_schema``) or vLLM's extras (``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structured_outputs``). At most one
may be set (a 400 names the second); the result is a StructuredOutputsParams (None: free text).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def request_constraint(req, error: Callable[[str, str], Exception]) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """(the constraint, the request field it came from). ``error(message, field)`` builds the
    exception to raise (an HTTP 400 in the server)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf.type == "structural_tag":
            tag = {k: v for k, v in (("structures", rf.structures), ("triggers", rf.triggers), ("format", rf.format))
                   if v is not None}
            if not tag:
                raise error("response_format of type structural_tag needs structures and triggers (or format)",
                            "response_format")
            found.append(("response_format", _build({"structural_tag": tag}, "response_format", error)))
        else:
            js = rf.json_schema
            if js is None or js.json_schema is None:
                raise error("response_format of type json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", _build({"json": js.json_schema}, "response_format.json_schema.schema",
                                                       error)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, _build({kind: value}, name, error)))
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object", "structural_tag"})
        if unknown:
            raise error(f"structured_outputs.{unknown[0]} is not supported (use json, regex, choice, grammar, "
                        "json_object or structural_tag)", f"structured_outputs.{unknown[0]}")
        found.append(("structured_outputs", _build(so, "structured_outputs", error)))
    if len(found) > 1:
        raise error(f"{found[1][0]} and {found[0][0]} both constrain the output: pass one", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _build(kwargs: dict[str, Any], field: str, error) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise error(f"{field}: {e}", field) from None


def rename_field(message: str, field: Optional[str]) -> str:
    """A compile error names ``structured_outputs.<kind>``; say which request field held it."""
    if field is None or field == "structured_outputs" or not message.startswith("structured_outputs."):
        return message
    name = message.split(" ", 1)[0].rstrip(":")  # structured_outputs.<kind>
    return field + message[len(name):]
