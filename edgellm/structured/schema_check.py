"""Which JSON-schema features a request may use: those the grammar engine (xgrammar) enforces.

A schema must be valid against the JSON Schema 2020-12 meta-schema (jsonschema's check), and may
not use a keyword the grammar cannot enforce: xgrammar ignores these silently, so an output
"constrained" by them could violate the schema. Such a schema is refused (400) naming the keyword
and where it is, rather than half-honoured. `format` is an annotation in JSON Schema 2020-12
and is kept as a hint (xgrammar enforces the common ones: date, time, uuid, ...).
"""

from __future__ import annotations

from typing import Any

UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "allOf",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentSchemas",
        "dependentRequired",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# keywords whose value is a schema, a list of schemas, or a name -> schema map
_SUB_SCHEMA = ("items", "additionalProperties", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "prefixItems")
_SUB_MAP = ("properties", "$defs", "definitions", "patternProperties")


def check_schema(schema: Any, source: str) -> None:
    """Raise StructuredOutputError unless `schema` is a valid JSON schema the grammar can
    enforce."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    from edgellm.structured.spec import StructuredOutputError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the root"
        raise StructuredOutputError(
            f"{source}: invalid JSON schema at {where}: {exc.message}", source
        ) from None
    problem = _unsupported(schema, "#")
    if problem is not None:
        keyword, where = problem
        raise StructuredOutputError(
            f"{source}: the JSON schema keyword {keyword!r} (at {where}) is not supported: output "
            f"constrained by this server could not be guaranteed to satisfy it",
            source,
        )


def _unsupported(node: Any, where: str) -> tuple[str, str] | None:
    if not isinstance(node, dict):
        return None
    for key in node:
        if key in UNSUPPORTED:
            return key, where
    for key in _SUB_SCHEMA:
        found = _unsupported(node.get(key), f"{where}/{key}")
        if found:
            return found
    for key in _SUB_LIST:
        for i, sub in enumerate(node.get(key) or []):
            found = _unsupported(sub, f"{where}/{key}/{i}")
            if found:
                return found
    for key in _SUB_MAP:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                found = _unsupported(sub, f"{where}/{key}/{name}")
                if found:
                    return found
    return None
