"""Random JSON schemas for the structured-output tests (shared with the benchmarks: they live in
edgellm/bench/schemas.py)."""

from edgellm.bench.schemas import random_schema, schemas  # noqa: F401  (re-exported for the tests)
