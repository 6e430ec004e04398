"""CPU mode "fast" for int4 weights: torch's packed int4 GEMV for decode-sized steps and a bf16
matmul over the dequantized weight for larger ones, built for CPUs with bf16 units.

The GEMV (`_weight_int4pack_mm_for_cpu`) takes bf16 activations and bf16 scales, so logits move
by about 1e-2 relative to the exact path. Its cost grows linearly with rows while a bf16 matmul
costs about the same from 1 to 32 rows, so steps of more than `gemv_max_rows` rows use the bf16
copy of the weight, kept from load while the load's dense budget lasts (Platform.reserve_dense);
past the budget a layer dequantizes into a transient fp32 matrix per call and keeps the GEMV up
to GEMV_MAX_ROWS_UNCACHED rows. With fp32 or fp16 activations torch's int4 GEMV takes a scalar
path, so it is bf16 or nothing. benchmarks/cpu_quant_decode.py measures the crossover
(benchmarks/results/cpu_quant_decode.json).

Which path a step takes depends on its row count, so in "fast" mode a sequence's logits can
depend (at bf16 noise level) on what it is batched with; "exact" has no such effect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgellm.quant.int_codes import Int4Codes
from edgellm.quant.linear_kernels.onednn import bf16_linear, onednn_linear, pack_bf16, row_bucket

if TYPE_CHECKING:
    from edgellm.platform import Platform

_TINYGEMM_GROUPS = (32, 64, 128, 256)
GEMV_MAX_ROWS_UNCACHED = 128  # without a bf16 copy the GEMV beats dequantizing per call to here


def gemv_max_rows(packed_bf16: bool) -> int:
    """Rows per call up to which the int4 GEMV beats the bf16 matmul over weights read from
    memory (the GEMV's cost steps up every 4 rows; oneDNN's blocked layout is flat from 1 row)."""
    return 4 if packed_bf16 else 12


class CpuInt4Kernel:
    """CPU: torch's packed int4 GEMV for small steps, a bf16 matmul over the dequantized weight for
    larger ones (fp32 when the dense budget is spent).

    Stored in input order sorted by group (desc_act g_idx becomes a permutation of x's
    columns). tinygemm computes w = (q - 8) * scale + zero per group with bf16 scale/zero;
    the exact copy keeps the codes as nibbles and the scales/zeros/offsets as given.
    """

    def __init__(
        self,
        c: Int4Codes,
        dtype: torch.dtype,
        perm: torch.Tensor | None,
        tinygemm_group: int,
        platform: Platform,
    ) -> None:
        q = c.codes.to(torch.int32)
        if perm is not None:
            q = q[:, perm]
        self.n, self.k = q.shape
        self.dtype = dtype
        self.perm = perm
        self.group_size = c.group_size
        scales = c.scales.float()
        offsets = None if c.offsets is None else c.offsets.float()
        if offsets is not None:  # w = q * s + offset (implicit zero code 0)
            zero = 8.0 * scales + offsets
        else:
            zero = (8.0 - (c.zeros.float() if c.zeros is not None else 8.0)) * scales
        rep = c.group_size // tinygemm_group
        sz = torch.stack((scales, zero), -1).repeat_interleave(rep, 1)  # [N, G', 2]
        self.scale_zero = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [G', N, 2]
        self.tinygemm_group = tinygemm_group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # the exact copy, for prefill: nibbles, and scales/offsets in fp16 when that is lossless
        half = self.k // 2
        self.nibbles = (q[:, :half] | (q[:, half:] << 4)).to(torch.uint8).contiguous()
        self.scales = _compact(scales)
        self.zeros = None if c.zeros is None else c.zeros.to(torch.uint8).contiguous()
        self.offsets = None if offsets is None else _compact(offsets)
        # the dequantized matrix in bf16 for larger steps, kept while the budget lasts
        dense = platform.reserve_dense(self.n * self.k * 2)
        self.dense_weight = pack_bf16(self.dense(), platform.packed_bf16) if dense else None
        # rows up to which the GEMV runs: past it, the bf16 copy (or a transient fp32 matrix)
        self.gemv_max_rows = (
            gemv_max_rows(platform.packed_bf16) if dense else GEMV_MAX_ROWS_UNCACHED
        )

    @classmethod
    def build(cls, c: Int4Codes, dtype: torch.dtype, platform: Platform) -> CpuInt4Kernel | None:
        """None when torch's int4 GEMV cannot hold these shapes (the caller stays dense)."""
        n, k = c.codes.shape
        gs = c.group_size
        perm = None
        if c.g_idx is not None:
            g = c.g_idx.long()
            plain = torch.arange(k) // gs
            if not torch.equal(g, plain):
                order = torch.argsort(g, stable=True)
                if not torch.equal(g[order], plain):
                    return None  # groups that are not a permutation of contiguous ones
                perm = order
        tg = gs
        while tg > max(_TINYGEMM_GROUPS) and tg % 2 == 0:
            tg //= 2  # a larger group (per-channel) repeats its scale over smaller ones: exact
        if tg not in _TINYGEMM_GROUPS or k % gs or n % 16:
            return None
        return cls(c, dtype, perm, tg, platform)

    def dense(self) -> torch.Tensor:
        """W [N, K] (stored column order) in fp32, exactly as the format defines it."""
        groups = self.k // self.group_size
        w = torch.cat((self.nibbles & 15, self.nibbles >> 4), 1).view(
            self.n, groups, self.group_size
        )
        w = w.float()
        if self.zeros is not None:
            w.sub_(self.zeros.float()[..., None])
        elif self.offsets is None:
            w.sub_(8.0)
        w.mul_(self.scales.float()[..., None])
        if self.offsets is not None:
            w.add_(self.offsets.float()[..., None])
        return w.view(self.n, self.k)

    def rounds_to_bf16(self, rows: int) -> bool:
        """Every path of this kernel rounds its input to bf16 (see
        CpuIntDotKernel.rounds_to_bf16)."""
        return True

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        dense = self.dense_weight
        rows = x2.shape[0]
        if 0 < rows <= self.gemv_max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(),
                self.packed,
                self.tinygemm_group,
                self.scale_zero,
            ).to(x.dtype)
        elif dense is not None:
            y = bf16_linear(x2.to(torch.bfloat16), dense).to(x.dtype)
        else:
            y = F.linear(x2, self.dense().to(x.dtype))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.n)


def warm_matmul_shapes(model: nn.Module, max_rows: int, decode_rows: int) -> int:
    """Build oneDNN's primitives for every oneDNN-blocked bf16 weight of `model` (and its fast
    logits head) at every row bucket up to `max_rows` (a step's token budget) and at every exact
    row count up to `decode_rows` (the fused C++ decode passes its batch unpadded), so that no
    request pays for one. A server does this once at start-up. Returns the number of matmuls run (0
    when the
    model keeps no oneDNN-blocked weight)."""
    weights: dict[tuple[int, int], torch.Tensor] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if (
            isinstance(kernel, CpuInt4Kernel)
            and kernel.dense_weight is not None
            and kernel.dense_weight.is_mkldnn
        ):
            weights.setdefault((kernel.n, kernel.k, kernel.gemv_max_rows), kernel.dense_weight)
    head = getattr(model, "fast_logits", None)
    bf16 = getattr(head, "bf16", None)  # the int8 head (IntDotLogitsHead) keeps no bf16 copy
    heads = [bf16] if bf16 is not None and bf16.is_mkldnn else []

    def rows_past(first: int, bucketed_to: int) -> list[int]:
        return sorted(
            {row_bucket(r) for r in range(first + 1, bucketed_to + 1)}
            | set(range(first + 1, decode_rows + 1))
        )

    work = [(w, rows_past(gemv, max_rows)) for (_, _, gemv), w in weights.items()]
    work += [(w, rows_past(head.int8_max_rows, decode_rows)) for w in heads]
    runs = 0
    with torch.inference_mode():
        for w, rows in work:
            for r in rows:
                onednn_linear(torch.zeros(r, w.shape[1], dtype=torch.bfloat16), w)
                runs += 1
    return runs


def _compact(t: torch.Tensor) -> torch.Tensor:
    half = t.half()
    return half.contiguous() if torch.equal(half.float(), t) else t.contiguous()
