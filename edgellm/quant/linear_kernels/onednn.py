"""bf16 matmuls through oneDNN, for CPUs with bf16 units (AMX, AVX512-BF16).

A weight is reordered once into oneDNN's blocked layout (`pack_bf16`); a matmul pads its rows
to one of a few buckets (`row_bucket`) because oneDNN builds (JIT-compiles) one primitive per
shape, so a server whose steps had ever-new row counts would pay that build in its requests.
Whether the blocked layout is used is a per-load choice (Platform.packed_bf16, from
`packed_available`); the plain layout runs the same math through F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgellm import env


def packed_available() -> bool:
    """Whether bf16 weights can be kept in oneDNN's blocked layout here: torch has the reorder
    op, the CPU has bf16 support, and EDGELLM_CPU_PACKED is not 0."""
    if not env.cpu_packed_enabled():
        return False
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
    except (AttributeError, RuntimeError):
        return False


def pack_bf16(weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """weight [N, K] in bf16 for bf16_linear: reordered into oneDNN's blocked layout when
    `packed` (an opaque mkldnn tensor; unpack_bf16 gives the plain matrix back)."""
    w = weight.to(torch.bfloat16).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, 16) if packed else w


def unpack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The plain bf16 matrix of a pack_bf16 weight."""
    return weight.to_dense() if weight.is_mkldnn else weight


def row_bucket(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at: few distinct shapes (about 90 up to
    8192 rows, inside oneDNN's primitive cache of 1024) at a padding cost under 1/4 of the rows
    (1/16 past 256)."""
    for limit, step in ((32, 1), (256, 16), (1024, 64)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 times a pack_bf16 weight: bf16 out, fp32 accumulation either way."""
    if not weight.is_mkldnn:
        return F.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x2 = F.pad(x2, (0, 0, 0, padded - rows))
    y = onednn_linear(x2, weight)
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times a oneDNN-blocked weight, at exactly M rows."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
