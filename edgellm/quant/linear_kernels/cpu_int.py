"""CPU mode auto: int4 and int8 weights times int8-quantized activations by integer dot products
(edgellm/kernels/csrc/cpu/qgemm_n16*.cpp), for every x86 CPU with AVX2.

int8 weights (Int8Codes: GGUF Q8_0, and the 5/6-bit and K-quant types unpacked to int8 codes,
W = scale * q (+ offset) per group of 32, or of 16 for Q6_K/Q3_K/Q2_K) keep their codes as they
are, the scales (and offsets) in fp16 when lossless; everything below holds for them too. In the
n16 layout, codes within -16..15 (Q5_0, Q3_K, Q2_K) are stored in 5 bits and codes within -32..31
(Q6_K, modules mixing Q4_K and Q6_K; IQ4's grid is wider) in 6 bits instead of 8 (`bits`): a decode
step reads fewer bytes, and the integer sums are the same. Codes within 0..31 (Q5_1, Q5_K) are
stored as they are in 5 bits, and symmetric int4 codes (Q4_0, symmetric GPTQ) as the codes - 8
stored + 8 with no offsets (both: another zero for the stored codes, qgemm_n16.h). Scales
and offsets that the codes carry as K-quants' integer multipliers of an fp16 per 256 columns
(SplitScales) are stored so in the n16 layout (cpu_int_storage.compact_scales): Q4_K's read 48
bytes per 32 columns of a 16-output tile instead of 128.

The weight is repacked once at load, interleaved 16 output rows at a time (the n16 layout of
qgemm_n16.h): the 8 or 16 lanes of a vector accumulator are outputs, summed by vpdpbusd on CPUs
with VNNI (AVX-512 VNNI, or AVX-VNNI's 256-bit one), by vpmaddubsw + vpmaddwd on AVX2 without it;
each 32-column block of a tile is AMX's B operand as it is, so steps of many rows run on AMX
tiles where the CPU has them. (The row layout of qgemm.cpp, each 32-column block as 16 bytes, is
what a level without that layout would take: CpuIsa.n16.) Either way a scale and an offset per group
(W = scale * q + offset covers zero points, symmetric codes and GGUF's Q4_1 minimum), in fp16
when that is lossless, else fp32. Activations are quantized per call to int8 per 32-column
block (llama.cpp's Q8_0 rule), so the result differs from the exact path only by that rounding:
per output at most sum_b (d_b / 2) * sum_{k in b} |W[n, k]| (d_b: the block's step), and in
practice its random-walk part (tests/kernels/test_cpu_int.py checks both against
edgellm/kernels/reference.py).

Large steps (prefill) are compute-bound, and there a dense matmul may win: on AVX2 fp32 FMA
and vpmaddubsw do the same multiply-adds per cycle, with bf16 units (AMX) bf16 wins outright.
On AMX CPUs calibrate() also measures the AMX tiles against VNNI and sets the row count from
which the tiles run (`amx_rows`). So the kernel may keep a dense copy (the load's budget permitting:
bf16 where the CPU has bf16
units, else fp32), and rows above `max_rows` use it. calibrate() measures the crossover for the
loaded model at load time (never a constant tuned on one CPU) and drops the dense copies when
integer dots win at every size it measures.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from edgellm.quant.linear_kernels.base import LinearKernel
from edgellm.quant.linear_kernels.cpu_int_storage import (
    compact_scales,
    fp16_if_exact,
    fp16_pair_if_exact,
    int4_affine,
    stored_codes,
    symmetric_int4,
)

if TYPE_CHECKING:
    from edgellm.platform import Platform
    from edgellm.quant.int_codes import Int4Codes, Int8Codes

logger = logging.getLogger(__name__)

BLOCK = 32  # the kernel's activation block; groups must be multiples of it
_EMPTY = torch.empty(0)


def act_order_perm(codes: Int4Codes | Int8Codes) -> tuple[bool, torch.Tensor | None]:
    """(ok, perm): a g_idx that is a permutation of contiguous groups becomes a permutation of
    x's columns (None: plain order); ok False when the groups are not that."""
    if getattr(codes, "g_idx", None) is None:
        return True, None
    k = codes.codes.shape[1]
    g = codes.g_idx.long()
    plain = torch.arange(k) // codes.group_size
    if torch.equal(g, plain):
        return True, None
    order = torch.argsort(g, stable=True)
    return bool(torch.equal(g[order], plain)), order


class CpuIntDotKernel(LinearKernel):
    """int4 or int8 codes x int8 activations (see the module docstring); fp32 models on CPU."""

    def __init__(self, codes: Int4Codes | Int8Codes, native: Any, platform: Platform) -> None:
        from edgellm.kernels.reference import pack_int4_blocks_ref, pack_int_n16_ref, tile_n16_ref
        from edgellm.quant.int_codes import Int8Codes
        from edgellm.quant.linear_kernels.onednn import pack_bf16

        _, perm = act_order_perm(codes)
        q = codes.codes
        if perm is not None:
            q = q[:, perm]
        self.native = native
        self.n, self.k = q.shape
        self.group = codes.group_size
        self.perm = perm
        int8 = isinstance(codes, Int8Codes)
        self.n16 = platform.isa.n16  # the interleaved layout (else the row layout)
        self.bits = 8 if int8 else 4  # the stored width (int8 codes in the n16 layout: 5, 6 or 8)
        self.zero = 0  # n16: what the stored codes hold on top of the codes (qgemm_n16.h)
        if int8:
            if self.n16:
                self.bits, self.zero = stored_codes(q)
            if codes.offsets is None:
                scale, offset = fp16_if_exact(codes.scales), _EMPTY
            else:
                scale, offset = fp16_pair_if_exact(codes.scales.float(), codes.offsets.float())
        elif self.n16 and symmetric_int4(codes):  # codes q - 8 stored + 8: no offsets to read
            q, self.zero = q.to(torch.int16) - 8, 8
            scale, offset = fp16_if_exact(codes.scales.float()), _EMPTY
        else:
            scale, offset = fp16_pair_if_exact(*int4_affine(codes))
        if self.n16:
            self.qweight = pack_int_n16_ref(q, self.bits, self.zero)
            compact = None if perm is not None else compact_scales(codes, scale, offset)
            if compact is not None:
                self.scale, self.offset = compact
            else:
                self.scale = tile_n16_ref(scale)
                self.offset = tile_n16_ref(offset) if offset.numel() else _EMPTY
        else:
            self.qweight = q.to(torch.int8).contiguous() if int8 else pack_int4_blocks_ref(q)
            self.scale, self.offset = scale, offset
        self.max_rows = 1 << 62  # rows up to which the integer dots run (calibrate() lowers it)
        self.amx_rows = 1 << 62  # rows from which the n16 layout runs on AMX tiles (calibrate())
        self.dense: torch.Tensor | None = None
        self.dense_bf16 = platform.isa.bf16_units
        if platform.reserve_dense(self.n * self.k * (2 if self.dense_bf16 else 4)):
            from edgellm.kernels.reference import int_weight_ref

            w = int_weight_ref(q, scale, offset if offset.numel() else None, self.group)
            self.dense = pack_bf16(w, platform.packed_bf16) if self.dense_bf16 else w.contiguous()

    @classmethod
    def can_implement(cls, **spec: Any) -> tuple[bool, str | None]:
        codes: Int4Codes | Int8Codes | None = spec.get("codes")
        platform: Platform | None = spec.get("platform")
        if codes is None:
            return False, "not int4 or int8 codes"
        if platform is None or not platform.int_dot:
            return False, "CPU mode is not auto (or the CPU has no AVX2)"
        if spec.get("native") is None:
            return False, "the C++ CPU kernels did not build"
        if spec.get("dtype") != torch.float32:
            return False, "the model is not fp32"
        from edgellm.quant.int_codes import Int8Codes

        n, k = codes.codes.shape
        int8 = isinstance(codes, Int8Codes)
        if (
            k % BLOCK
            or k % codes.group_size
            or (codes.group_size % BLOCK and not (int8 and codes.group_size == 16))
        ):
            return False, (
                f"group {codes.group_size} is not a multiple of {BLOCK} (or, for int8 codes, 16) "
                f"dividing K = {k}"
            )
        if not act_order_perm(codes)[0]:
            return False, "act-order groups that are not a permutation of contiguous ones"
        return True, None

    def int_dot(
        self, x2: torch.Tensor, bias: torch.Tensor | None, amx_rows: int | None = None
    ) -> torch.Tensor:
        """x2 [M, K] fp32 (stored column order) -> [M, N] fp32 by integer dots (n16: on AMX tiles
        from `amx_rows` rows, default self.amx_rows)."""
        b = _EMPTY if bias is None else bias
        if self.n16:
            return self.native.int_linear_n16(
                x2,
                self.qweight,
                self.scale,
                self.offset,
                self.bits,
                self.group,
                b,
                self.n,
                self.amx_rows if amx_rows is None else amx_rows,
                self.zero,
            )
        return self.native.int_linear(
            x2, self.qweight, self.scale, self.offset, self.bits, self.group, b
        )

    def dense_matmul(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2 [M, K] (fp32, or bf16 for a bf16 copy) times the dense copy: bf16 out from a bf16
        copy (bias added in fp32), fp32 from an fp32 one."""
        from edgellm.quant.linear_kernels.onednn import bf16_linear

        if self.dense_bf16:
            y = bf16_linear(x2.to(torch.bfloat16), self.dense)
            return y if bias is None else (y.float() + bias).to(torch.bfloat16)
        return F.linear(x2.float(), self.dense, bias)

    def rounds_to_bf16(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs the bf16 dense copy (which rounds its input to bf16
        anyway, so a caller may hand it bf16 and take bf16 back)."""
        return self.dense is not None and self.dense_bf16 and rows > self.max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 (or bf16) -> [..., N] in x's dtype."""
        x2 = x.reshape(-1, self.k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.shape[0] <= self.max_rows or self.dense is None:
            y = self.int_dot(x2.float().contiguous(), bias)
        else:
            y = self.dense_matmul(x2.contiguous(), bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)


CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def int_dot_kernels(model: torch.nn.Module) -> list[CpuIntDotKernel]:
    """The integer-dot kernels of a loaded model's linears (empty: its linears are exact)."""
    kernels = (getattr(m, "kernel", None) for m in model.modules())
    return [k for k in kernels if isinstance(k, CpuIntDotKernel)]


def _time(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate_amx(kernels: list[CpuIntDotKernel], layers: int = 2) -> int | None:
    """On a host whose kernels run AMX tiles: measure the n16 kernels of the first `layers`
    layers on AMX tiles against VNNI at CALIBRATION_ROWS and set every n16 kernel's amx_rows to
    the smallest row count from which the tiles were faster at every size measured (None, and
    VNNI throughout, when they never were or the host has no AMX)."""
    n16 = [k for k in kernels if k.n16]
    if not n16 or not n16[0].native.amx_ready():
        return None
    sample = n16[: max(1, layers * 4)]
    never = 1 << 62
    wins = []
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            xs = [torch.randn(rows, k.k) for k in sample]
            t_vnni = _time(lambda xs=xs: [k.int_dot(x, None, never) for k, x in zip(sample, xs)])
            t_amx = _time(lambda xs=xs: [k.int_dot(x, None, 0) for k, x in zip(sample, xs)])
            wins.append(t_amx < t_vnni)
    start = next((i for i in range(len(wins)) if all(wins[i:])), None)
    amx_rows = CALIBRATION_ROWS[start] if start is not None else None
    for k in n16:
        k.amx_rows = never if amx_rows is None else amx_rows
    logger.info(
        "AMX tiles vs VNNI: %s",
        f"tiles from {amx_rows} rows" if amx_rows else "VNNI at every size measured",
    )
    return amx_rows


def calibrate(kernels: list[CpuIntDotKernel], layers: int = 2) -> int | None:
    """calibrate_amx, then measure integer dots against the dense copies on the first `layers`
    layers' worth of kernels (each kernel's shape, fresh random activations) at CALIBRATION_ROWS,
    set every
    kernel's max_rows to the largest row count up to which the integer dots were not slower, and
    drop the dense copies when they never won. Returns that crossover (None: nothing to measure)."""
    calibrate_amx(kernels, layers)
    with_dense = [k for k in kernels if k.dense is not None]
    if not with_dense:
        return None
    sample = with_dense[: max(1, layers * 4)]
    crossover = CALIBRATION_ROWS[-1]
    dense_won = False
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            xs = [torch.randn(rows, k.k) for k in sample]
            t_int = _time(lambda xs=xs: [k.int_dot(x, None) for k, x in zip(sample, xs)])
            t_dense = _time(lambda xs=xs: [k.dense_matmul(x, None) for k, x in zip(sample, xs)])
            if t_dense < t_int:
                dense_won = True
                crossover = rows // 2 if rows > 1 else 0
                break
    for k in kernels:
        k.max_rows = crossover if dense_won else 1 << 62
        if not dense_won:
            k.dense = None
    logger.info(
        "int-dot vs dense matmul crossover: %s",
        f"{crossover} rows"
        if dense_won
        else f"integer dots at every size up to {CALIBRATION_ROWS[-1]} rows (dense copies dropped)",
    )
    return crossover if dense_won else None
