"""OpenAI's strict schemas (`strict: true` on `response_format.json_schema` and on function definitions): every
object closed (`additionalProperties: false`) and every property required, so constrained output holds the
schema's keys and only those (a pydantic model's schema says neither, and JSON Schema would allow extra keys).
"""

from __future__ import annotations

from typing import Any

from tokenflow.errors import InvalidRequest

__all__ = ("strict_schema",)

_NESTED_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_NESTED_MAPS = ("properties", "$defs", "definitions", "patternProperties")
MAX_DEPTH = 64  # schemas are request fields: a bound on the walk


def strict_schema(schema: Any, field: str = "response_format", depth: int = 0) -> Any:
    """A copy of `schema` under OpenAI's strict rules; `InvalidRequest` naming `field` where it opens an object
    (`additionalProperties` other than false)."""
    if depth > MAX_DEPTH:
        raise InvalidRequest(f"the schema nests deeper than {MAX_DEPTH} levels", field=field)
    if isinstance(schema, list):
        return [strict_schema(s, field, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _NESTED_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s, field, depth + 1) for s in out[key]]
    for key in _NESTED_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s, field, depth + 1) for name, s in out[key].items()}
    for key in ("items", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key], field, depth + 1)
    types = out.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out:
        extra = out.get("additionalProperties", False)
        if extra is not False:
            raise InvalidRequest("a strict schema closes every object: `additionalProperties` must be false",
                                 field=field)
        out["additionalProperties"] = False
        out["required"] = list(out.get("properties", {}))
    return out
