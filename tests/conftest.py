"""Shared fixtures: tiny random-weight checkpoints built from transformers configs."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# No GPU here: Triton kernels run on CPU tensors in the interpreter. It must be set before
# anything imports triton (the kernel modules do, through the model layers).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Build (once per session) a tiny checkpoint per architecture; returns a getter."""
    from tests.tiny_models import build_tiny

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get
