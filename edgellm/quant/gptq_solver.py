"""GPTQ (Frantar et al., 2022): quantize a linear weight column by column,
compensating each column's rounding error on the columns not yet quantized
with the inverse Hessian of the layer's reconstruction loss ||WX - QX||^2.

H = 2 X^T X / n from the calibration inputs of the linear; the upper Cholesky
factor of the damped H^-1 gives the update rows. Columns are processed in
blocks (lazy batch updates: the error of a block reaches the remaining
columns in one matmul). Group scales are computed when a group is entered,
from the already error-compensated weights. Act-order processes columns by
decreasing diag(H): "static" keeps contiguous groups whose scales come from
the original weight (llm-compressor's `actorder: static`, no g_idx on disk),
"group" forms groups in the processing order and records them in g_idx.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from edgellm.quant.qparams import IntSpec, IntWeight, int_qparams, quantize_codes

logger = logging.getLogger(__name__)


class HessianAccumulator:
    """Running 2 X^T X / n over the rows of every input batch a linear sees."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.t(), x)
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.n == 0:
            raise RuntimeError("GPTQ: no calibration rows reached this linear")
        return (2.0 / self.n * self.h).float()


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp*mean(diag H) I)^-1, raising damp until it is PD."""
    k = h.shape[0]
    mean_diag = float(torch.mean(torch.diag(h)))
    for _attempt in range(8):
        hd = h.clone()
        hd.diagonal().add_(damp * mean_diag)
        try:
            lower = torch.linalg.cholesky(hd.double())
            inv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inv, upper=True).float()
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            logger.info("GPTQ: H not positive definite with damp %.3g, retrying", damp)
            damp = damp * 10 if damp > 0 else 1e-3
    raise RuntimeError(
        f"GPTQ: Hessian of size {k} is not positive definite even with damping {damp}"
    )


@contextmanager
def single_thread():
    """The column loop is thousands of small ops: a thread pool only adds sync cost (10-40x on a
    busy
    2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gptq_quantize(
    weight: torch.Tensor,  # [N, K]
    hessian: torch.Tensor,  # [K, K]
    spec: IntSpec,
    scale_dtype: torch.dtype,
    actorder: str | None = None,  # None | "static" | "group"
    damp: float = 0.01,
    block_size: int = 128,
) -> IntWeight:
    if actorder not in (None, "static", "group"):
        raise ValueError(f"actorder must be None, 'static' or 'group', got {actorder!r}")
    with single_thread():
        return _gptq(weight, hessian, spec, scale_dtype, actorder, damp, block_size)


def _gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: IntSpec,
    scale_dtype: torch.dtype,
    actorder: str | None,
    damp: float,
    block_size: int,
) -> IntWeight:
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.float().clone()
    g = spec.group_len(k)
    if k % g:
        raise ValueError(f"group size {g} does not divide the input dim {k}")
    num_groups = k // g
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    # Scales fixed up front (per channel, or static act-order): from the original weight.
    static = spec.group_size <= 0 or actorder == "static"
    scales = torch.zeros(n, num_groups)
    zeros = torch.zeros(n, num_groups)
    if static:
        for gi in range(num_groups):
            scales[:, gi], zeros[:, gi] = int_qparams(
                w[:, gi * g : (gi + 1) * g], spec, scale_dtype
            )

    perm = None
    if actorder is not None:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    # column (in processing order) -> group of its scale
    if static:
        col_group = (perm if perm is not None else torch.arange(k)) // g
    else:
        col_group = torch.arange(k) // g

    hinv = _inverse_cholesky(h, damp)
    # a dynamic group must start and end inside one block
    block = block_size if static else g * max(1, block_size // g)
    codes = torch.zeros(n, k)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if not static and col % g == 0:
                gi = col // g
                scales[:, gi], zeros[:, gi] = int_qparams(w1[:, i : i + g], spec, scale_dtype)
            gi = int(col_group[col])
            s, z = scales[:, gi], zeros[:, gi]
            col_w = w1[:, i]
            q = quantize_codes(col_w, s, z, spec.maxq)
            codes[:, col] = q
            err = (col_w - (q - z) * s) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if actorder == "group":
            g_idx = (torch.arange(k) // g)[inv].to(torch.int32)
    return IntWeight(
        codes.to(torch.int32),
        scales,
        None if spec.symmetric else zeros.to(torch.int32),
        spec,
        g_idx,
    )
