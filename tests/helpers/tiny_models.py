"""Tiny random-weight models of every supported architecture (edgellm/bench/tiny_models.py,
shared with the benchmarks), re-exported for the tests."""

from edgellm.bench.tiny_models import (  # noqa: F401  (re-exported for the tests)
    ARCHS,
    COMMON,
    build_tiny,
    tiny_config,
)
