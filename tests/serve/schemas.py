"""The JSON schemas of the structured-output proofs (test_structured.py over a random BPE model,
test_structured_char.py over a trained character model): objects, arrays, enums, nesting,
``required`` and optional keys, bounded numbers, strings with ``pattern`` and ``maxLength``."""

from __future__ import annotations

import json

import jsonschema

SCHEMAS = {
    "enum_and_bounded_integer": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 20},
        },
        "required": ["color", "count"],
    },
    "array_of_bounded_integers": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested_with_bounded_numbers": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"],
            },
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["point", "ratio"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
        },
        "required": ["zip", "code"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 9},
                "tag": {"type": "string", "maxLength": 5},
            },
            "required": ["id", "tag"],
        },
        "maxItems": 3,
    },
    "optional_keys": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}, "b": {"enum": ["x", "y"]}},
        "required": ["a"],
    },
}


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True
