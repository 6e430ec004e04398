"""The interface of a linear's matmul kernel and the chooser over candidates."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class LinearKernel(ABC):
    """y = x W^T (+ bias) for one loaded linear, in whatever layout the kernel keeps W."""

    @classmethod
    @abstractmethod
    def can_implement(cls, **spec: Any) -> tuple[bool, str | None]:
        """(True, None) when this kernel runs the weight `spec` describes on this platform, else
        (False, why not)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] in the model dtype -> [..., N] in the model dtype."""


def choose(
    candidates: Sequence[type[LinearKernel]], **spec: Any
) -> tuple[type[LinearKernel] | None, list[str]]:
    """The first candidate that can implement `spec`, and the reasons the ones before it gave."""
    reasons = []
    for kernel in candidates:
        ok, why = kernel.can_implement(**spec)
        if ok:
            return kernel, reasons
        reasons.append(f"{kernel.__name__}: {why}")
    return None, reasons
