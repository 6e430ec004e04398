"""Structured outputs: what a request constrains its output to (spec), the schema features the
grammar engine enforces (schema_check), and the compiled grammars and per-sequence matchers that
turn a constraint into a token mask for the sampler (grammar)."""

from edgellm.structured.spec import StructuredOutputError, StructuredOutputs

__all__ = ["StructuredOutputError", "StructuredOutputs"]
