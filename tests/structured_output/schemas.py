"""Random JSON schemas whose every instance is short: bounded strings and arrays, nested objects,
enums, integers and numbers with bounds, required and optional properties, additionalProperties
false. A constrained generation of one always ends within a few hundred tokens."""
from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "q\"uote", "ünï"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    props = {f"p{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
    required = sorted(rng.sample(sorted(props), rng.randint(0, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_object_schema(rng: random.Random) -> dict:
    """A top-level object schema (the usual response_format shape)."""
    while True:
        s = random_schema(rng)
        if s.get("type") == "object":
            return s
