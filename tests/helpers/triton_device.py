"""The device Triton kernel tests run on: CUDA when present, else CPU tensors under Triton's
interpreter (set up in tests/conftest.py). A test module that runs kernels also marks itself
`pytestmark = pytest.mark.usefixtures("triton_device")`, which fails it when the interpreter is
not active on a CPU host."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
