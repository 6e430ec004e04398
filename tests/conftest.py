"""Shared set-up for every test: the environment (offline hub, Triton's CPU interpreter) and the
tiny random-weight checkpoints built from transformers configs.

The environment is set in `pytest_configure`, which runs before any test module is imported:
Triton's interpreter only works when TRITON_INTERPRET=1 is set before triton is first imported,
so no test may depend on which module happens to import the kernels first. The session fixture
`triton_device` is what kernel tests use: the device Triton kernels run on here ("cuda", or "cpu"
under the interpreter); it fails, never skips, when the interpreter is not active on a CPU host.
Every test starts from the same global RNG state (`_seeded_rng`).
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test starts from the same global RNG state, so what a test draws from torch's
    global generator does not depend on which tests ran before it."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """ "cuda" when a GPU is present, else "cpu" with the kernels built for the interpreter."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    from edgellm.kernels import gemm_common

    assert gemm_common.interpreting(), "triton kernels were built without TRITON_INTERPRET=1"
    return "cpu"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Build (once per session) a tiny checkpoint per architecture; returns a getter."""
    from tests.helpers.tiny_models import build_tiny

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get
