"""The structured-outputs benchmark's JSON schema (``scripts/bench_structured.py``,
docs/structured-outputs.md): the tests constrain by the same schema, so what is measured
is what is tested."""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA"]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}
