"""50 JSON schemas for the structured-output tests: every shape the docs promise (objects,
nesting, arrays, enums, const, numbers and integers with bounds, required and optional
properties, string patterns, lengths and formats, anyOf, $defs/$ref).

A random-weight model writes whatever its grammar allows, so every leaf is bounded
(strings by maxLength, a pattern or an enum; numbers by minimum/maximum; arrays by
maxItems): an unbounded string would run on until max_tokens, since a random model
closes a quote with a probability of about one in the vocabulary per token."""
from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

_LEAVES: list[Schema] = [
    {"type": "string", "maxLength": 6},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]{1,5}$"},
    {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": ["a", 1, None, True]},
    {"const": "fixed"},
    {"type": "integer", "minimum": 0, "maximum": 120},
    {"type": "integer", "minimum": -50, "maximum": -10},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "number", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0.5, "maximum": 100.25},
    {"type": "boolean"},
    {"type": "null"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
]


def _leaf(rng: random.Random) -> Schema:
    return dict(rng.choice(_LEAVES))


def _array(rng: random.Random, items: Schema) -> Schema:
    low = rng.randint(0, 2)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 3)}


def _object(rng: random.Random, depth: int) -> Schema:
    names = rng.sample(["id", "name", "age", "tags", "score", "ok", "kind", "when", "note", "x"], rng.randint(1, 4))
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]  # the rest are optional
    schema: Schema = {"type": "object", "properties": props, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> Schema:
    if depth >= 2:
        return _leaf(rng)
    kind = rng.random()
    if kind < 0.5:
        return _leaf(rng)
    if kind < 0.75:
        return _array(rng, _value(rng, depth + 1))
    return _object(rng, depth)


def _with_ref(rng: random.Random) -> Schema:
    point = {"type": "object", "properties": {"x": _leaf(rng), "y": _leaf(rng)}, "required": ["x", "y"]}
    return {"$defs": {"point": point}, "type": "object",
            "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3}},
            "required": ["points"]}


def schemas(count: int = 50, seed: int = 0) -> list[Schema]:
    """`count` schemas: each leaf on its own first, one $ref schema, then random objects
    and arrays of up to three levels."""
    rng = random.Random(seed)
    out: list[Schema] = [dict(leaf) for leaf in _LEAVES]
    out.append(_with_ref(rng))
    while len(out) < count:
        out.append(_object(rng, 0) if rng.random() < 0.7 else _array(rng, _value(rng, 1)))
    return out[:count]
