"""Matmul backends for weight-quantized linears: what a QuantLinearMethod runs once
its format has decoded the checkpoint tensors (schemes.QuantLinearMethod).

- CUDA: int4 (AWQ, GPTQ, compressed-tensors, GGUF Q4_0/Q4_1/Q4_K, the last two with
  offsets) is repacked once into the W4A16 Triton kernel's layout; GGUF's other types run
  as int8 codes with group scales in the grouped W8 kernel; anything else is dequantized once.
- 8-bit weights with 8-bit activations (W8A8): int8 runs exact integer math on CPU
  (torch._int_mm, activations quantized per token like compressed-tensors), fp8
  dequantizes the weight once and rounds activations through fp8; on CUDA both use
  the Triton kernels. Fused shards with different static input scales quantize
  the activations once per shard.
- CPU "exact": the weights are dequantized once to the model dtype with the
  format's exact formula; F.linear in fp32.
- CPU "fast": int4 stays int4, and everything wider runs in bf16 on the CPU's
  bf16 matrix units (AMX / AVX512-BF16 through oneDNN). Rows of a step up to
  GEMV_MAX_ROWS (decode) go through torch's packed int4 GEMV
  (`_weight_int4pack_mm_for_cpu`, bf16 activations and bf16 scales: about 3
  significant digits, so logits move by ~1e-2 relative to the exact path).
  Its cost grows linearly with rows, while a bf16 matmul over the dequantized
  weight costs about the same from 1 to 32 rows, so larger steps (batched
  decode, prefill) use that bf16 matrix: kept from load while the
  process-wide budget EDGELLM_CPU_DENSE_CACHE_MB (default 2048) lasts
  (dequantizing every layer per step would cost ~45 ms on SmolLM2-135M).
  Past the budget a layer dequantizes into a transient fp32 matrix per call
  and keeps the GEMV up to GEMV_MAX_ROWS_UNCACHED rows. Measured on a 2-core
  Xeon with AMX, ms per SmolLM2-135M layer (its four matmuls), cycling over 30
  layers' weights so they come from memory as in a real step: int4 GEMV /
  bf16 / fp32 at 1 row 0.12 / 0.52 / 0.50, 8 rows 0.34 / 0.55 / 1.07, 12 rows
  0.50 / 0.54 / 1.28, 16 rows 0.66 / 0.55 / 1.22, 64 rows 2.49 / 0.76 / 2.39;
  on 128 rows with warm caches bf16 is 3.5x the fp32 speed
  (benchmarks/cpu_quant_decode.py sweeps one layer). With fp32 or fp16
  activations torch's int4 GEMV takes a scalar path (100x slower), so it is
  bf16 or nothing.

  Which path a step takes depends on its row count, so in "fast" mode a
  sequence's logits can depend (at bf16 noise level) on what it is batched
  with; "exact" has no such effect.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgellm import env
from edgellm.quant.schemes import Int4Codes, Int8Codes

if TYPE_CHECKING:
    from edgellm.platform import Platform
    from edgellm.quant.schemes import QuantLinearMethod

logger = logging.getLogger(__name__)

def _packed_available() -> bool:
    if not env.cpu_packed_enabled():
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


PACKED_BF16 = _packed_available()
# rows per call up to which the CPU int4 GEMV beats the bf16 matmul (weights from memory); its cost
# steps up every 4 rows
GEMV_MAX_ROWS = 4 if PACKED_BF16 else 12
GEMV_MAX_ROWS_UNCACHED = 128  # ... and beats dequantizing per call


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in bf16 for bf16_linear: reordered once into oneDNN's blocked layout when
    torch has it (an opaque mkldnn tensor; unpack_bf16 gives the plain matrix back)."""
    w = weight.to(torch.bfloat16).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, 16) if PACKED_BF16 else w


def unpack_bf16(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_dense() if weight.is_mkldnn else weight


def row_bucket(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at. oneDNN builds (JIT-compiles) a
    primitive per shape, ~2-4 ms each, so a server whose steps have ever-new row counts would pay
    ~10 ms per step; padded to these buckets the shapes stay few (~90 up to 8192 rows, inside
    oneDNN's primitive cache of 1024) at a padding cost under 1/4 of the rows (1/16 past 256)."""
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
    y = _onednn_linear(x2, weight)
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times a oneDNN-blocked weight, at exactly M rows."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


_TINYGEMM_GROUPS = (32, 64, 128, 256)


class DenseKernel:
    """y = x W^T with W dequantized once (model dtype)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class TritonInt4Kernel:
    """CUDA: the W4A16 dequant-GEMM over the canonical layout (edgellm/kernels/int4_layouts)."""

    def __init__(self, codes: Int4Codes, device: torch.device) -> None:
        from edgellm.kernels.int4_layouts import repack_int4

        w = repack_int4(codes.codes, codes.zeros, codes.scales, codes.group_size, codes.g_idx,
                        offsets=codes.offsets)
        for name, value in vars(w).items():
            if isinstance(value, torch.Tensor):
                setattr(w, name, value.to(device))
        self.weight = w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.dequant_gemm import w4a16_gemm

        return w4a16_gemm(x, **vars(self.weight), bias=bias)


class TritonInt8GroupedKernel:
    """CUDA: int8 codes with group scales and offsets (GGUF's 5/6/8-bit types and K-quants)
    through the grouped W8 GEMM (edgellm/kernels/grouped_gemm)."""

    def __init__(self, codes: Int8Codes, device: torch.device) -> None:
        self.codes = codes.codes.to(device=device, dtype=torch.int8).contiguous()
        self.scales = codes.scales.float().t().contiguous().to(device)
        self.offsets = None if codes.offsets is None else codes.offsets.float().t().contiguous().to(device)
        self.group_size = codes.group_size

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.grouped_gemm import w8g_gemm

        return w8g_gemm(x, self.codes, self.scales, self.group_size, self.offsets, bias=bias)


class CpuInt4Kernel:
    """CPU: torch's packed int4 GEMV for small steps, a bf16 matmul over the dequantized weight for
    larger ones (fp32 when the dense budget is spent).

    Stored in input order sorted by group (desc_act g_idx becomes a permutation of x's
    columns). tinygemm computes w = (q - 8) * scale + zero per group with bf16 scale/zero;
    the exact copy keeps the codes as nibbles and the scales/zeros/offsets as given.
    """

    def __init__(self, c: Int4Codes, dtype: torch.dtype, perm: torch.Tensor | None,
                 tinygemm_group: int, platform: Platform) -> None:
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
        self.dense_weight = pack_bf16(self.dense()) if platform.reserve_dense(self.n * self.k * 2) else None

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
        w = torch.cat((self.nibbles & 15, self.nibbles >> 4), 1).view(self.n, groups, self.group_size)
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
        """Every path of this kernel rounds its input to bf16 (see CpuIntDotKernel.rounds_to_bf16)."""
        return True

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        dense = self.dense_weight
        rows = x2.shape[0]
        if 0 < rows <= (GEMV_MAX_ROWS if dense is not None else GEMV_MAX_ROWS_UNCACHED):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16).contiguous(), self.packed, self.tinygemm_group, self.scale_zero
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
    request pays for one. A server does this once at start-up (about 1 s for SmolLM2-135M at the
    default budgets). Returns the number of matmuls run."""
    weights: dict[tuple[int, int], torch.Tensor] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, CpuInt4Kernel) and kernel.dense_weight is not None and kernel.dense_weight.is_mkldnn:
            weights.setdefault((kernel.n, kernel.k), kernel.dense_weight)
    head = getattr(model, "fast_logits", None)
    bf16 = getattr(head, "bf16", None)  # the int8 head (IntDotLogitsHead) keeps no bf16 copy
    heads = [bf16] if bf16 is not None and bf16.is_mkldnn else []
    layer_rows = sorted({row_bucket(r) for r in range(GEMV_MAX_ROWS + 1, max_rows + 1)}
                        | set(range(GEMV_MAX_ROWS + 1, decode_rows + 1)))
    head_rows = sorted({row_bucket(r) for r in range(CpuFastLogitsHead.INT8_MAX_ROWS + 1, decode_rows + 1)})
    runs = 0
    with torch.inference_mode():
        for w, rows in [(w, layer_rows) for w in weights.values()] + [(w, head_rows) for w in heads]:
            for r in rows:
                _onednn_linear(torch.zeros(r, w.shape[1], dtype=torch.bfloat16), w)
                runs += 1
    return runs


def _compact(t: torch.Tensor) -> torch.Tensor:
    half = t.half()
    return half.contiguous() if torch.equal(half.float(), t) else t.contiguous()


def layer_device(layer: nn.Module) -> torch.device:
    return getattr(layer, "device", None) or torch.device("cpu")


def use_triton(device: torch.device) -> bool:
    """CUDA runs the Triton kernels. Tests can run the same path on CPU tensors under
    the Triton interpreter (TRITON_INTERPRET=1 and EDGELLM_TRITON_ON_CPU=1)."""
    return device.type == "cuda" or env.triton_on_cpu()


def build_kernel(method: QuantLinearMethod, layer: nn.Module, platform: Platform):
    """The matmul for a loaded weight-quantized linear (see the module docstring)."""
    device = layer_device(layer)
    codes = method.int4(layer)
    if use_triton(device):
        if codes is not None:
            return TritonInt4Kernel(codes, device)
        if (codes8 := method.int8(layer)) is not None:
            return TritonInt8GroupedKernel(codes8, device)
    elif platform.cpu_quant == "auto" and (codes is not None or (codes := method.int8(layer)) is not None):
        from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel

        native = platform.native()
        ok, why = CpuIntDotKernel.can_implement(codes=codes, platform=platform, native=native, dtype=layer.dtype)
        if ok:
            return CpuIntDotKernel(codes, native, platform)
        logger.info("%s: %s; dequantized instead", layer.prefix, why)
    elif platform.cpu_quant == "fast" and codes is not None:
        kernel = CpuInt4Kernel.build(codes, layer.dtype, platform)
        if kernel is not None:
            return kernel
        logger.info("%s: int4 shapes unsuited to the CPU int4 GEMV; dequantized instead", layer.prefix)
    return DenseKernel(method.dequantize(layer).to(device=device, dtype=layer.dtype))


class CpuFastLogitsHead:
    """CPU "fast": the logits projection for rows that need nothing but their argmax (greedy, no
    penalties, no logprobs; the engine decides). It is the largest matrix of a small model
    (SmolLM2's tied 49152 x 576 embedding is 113 MB in fp32, more than all its int4 layers).
    Up to INT8_MAX_ROWS such rows read it as int8 per output row through torch's int8 GEMV
    (`_weight_int8pack_mm`, 28 MB); more rows use a bf16 copy on the bf16 matrix units (its cost
    is flat in rows). Every other row (sampling, logprobs, prompt logits) takes the fp32 weight.

    The argmax stays the fp32 head's: each approximate logit is within B of the fp32 one (weight
    rounding, bf16 activations, bf16 output; bound() below: 8 standard deviations of the rounding
    noise), so only tokens whose approximate logit is within 2B of the row's maximum can hold the
    true maximum. Those
    candidates are recomputed in fp32 from the full-precision rows and written back; the other
    logits stay approximate and below them. When a row has more than MAX_CANDIDATES candidates
    (a flat distribution) it is recomputed whole in fp32."""

    masked = None  # (x, allowed) -> logits exact on the masked argmax; see IntDotLogitsHead.masked
    INT8_MAX_ROWS = 2 if PACKED_BF16 else 4  # beyond: the bf16 copy (oneDNN-blocked: flat 1.2 ms to 16 rows)
    MAX_CANDIDATES = 2048
    SIGMAS = 8.0

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        absmax = w.abs().amax(1)
        scale = (absmax / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(torch.bfloat16)
        bf16 = w.to(torch.bfloat16)
        # largest per-row mean squares of the weight and of each copy's rounding error
        self.w_ms = float(w.square().mean(1).max())
        err = w - self.codes.float() * self.scales.float()[:, None]
        self.err_ms_int8 = float(err.square().mean(1).max())
        self.err_ms_bf16 = float((w - bf16.float()).square().mean(1).max())
        self.bf16 = pack_bf16(bf16)
        self.weight = weight  # the model's own (tied) matrix: no copy

    def __call__(self, x: torch.Tensor, argmax_only: list[bool] | None = None) -> torch.Tensor:
        """argmax_only: per row, whether only its argmax is needed (None: all rows)."""
        rows = x.shape[0]
        approx = list(range(rows)) if argmax_only is None else [i for i, a in enumerate(argmax_only) if a]
        if not approx or x.dtype != torch.float32:
            return F.linear(x, self.weight).float()
        if len(approx) == rows:
            return self._approx(x)
        out = F.linear(x, self.weight).float()  # rows that need every logit
        idx = torch.tensor(approx)
        out[idx] = self._approx(x[idx])
        return out

    def bound(self, x: torch.Tensor, xb: torch.Tensor, top: torch.Tensor, int8: bool) -> torch.Tensor:
        """[M, 1]: the half-width of the window around an approximate logit that holds the fp32
        one. xb: x in bf16, as the GEMV saw it; top [M, 1]: the largest |approximate logit| of each
        row. The output's bf16 rounding is bounded outright (2^-9 of |logit|). The dot product's
        error, sum_k x_k e_k + d_k w_k (e: the weight's rounding, known at load; d = x - bf16(x),
        known here), is a sum of K terms of mixed sign with standard deviation
        sigma = sqrt(|x|^2 ms(e) + |d|^2 ms(w)) (ms: the largest mean square over the rows);
        SIGMAS standard deviations of it. A worst-case bound (|x|_1 max|e|) is ~15x wider on real
        hidden states and leaves thousands of candidates; tests/quant/test_default_model.py
        measures the largest error in sigmas on the model's own hidden states."""
        d = x - xb.float()
        ms_e = self.err_ms_int8 if int8 else self.err_ms_bf16
        sigma = (x.square().sum(-1, keepdim=True) * ms_e + d.square().sum(-1, keepdim=True) * self.w_ms).sqrt()
        return self.SIGMAS * sigma + top * (1 / 256)

    def approximate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(approximate fp32 logits [M, V], each row's max [M, 1], the window half-width [M, 1]),
        before any refinement."""
        xb = x.to(torch.bfloat16)
        int8 = x.shape[0] <= self.INT8_MAX_ROWS
        if int8:
            logits = torch._weight_int8pack_mm(xb, self.codes, self.scales).float()
        else:
            logits = bf16_linear(xb, self.bf16).float()
        hi, lo = logits.amax(-1, keepdim=True), logits.amin(-1, keepdim=True)
        return logits, hi, self.bound(x, xb, torch.maximum(hi, -lo), int8)

    def _approx(self, x: torch.Tensor) -> torch.Tensor:
        logits, hi, bound = self.approximate(x)
        floor = hi - 2 * bound
        rows, cols = (logits >= floor).nonzero(as_tuple=True)
        # a row over MAX_CANDIDATES (only possible when the total is) is recomputed whole
        if rows.numel() > self.MAX_CANDIDATES and int(torch.bincount(rows).max()) > self.MAX_CANDIDATES:
            return F.linear(x, self.weight).float()
        logits[rows, cols] = (x[rows] * self.weight[cols]).sum(-1)
        return logits


# -- 8-bit weights with 8-bit activations (compressed-tensors int-quantized / float-quantized) --

INT8_ACT_RANGE = 127.5  # compressed-tensors: absmax / ((q_max - q_min) / 2), then round and clamp to int8
Segment = tuple[int, int, "torch.Tensor | None"]  # output rows [start, end) sharing a static input scale


def quant_int8_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes, fp32 scale [M, 1]) as compressed-tensors quantizes activations:
    scale = absmax / 127.5 per token (or the static one), q = clamp(round(x / scale), -128, 127)."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / INT8_ACT_RANGE).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale


class Int8W8A8Kernel:
    """int8 activations (per token, or static per shard) x int8 weights, int32 accumulation.
    CPU: torch._int_mm (exact integer math); CUDA: activations quantized the same way,
    dequantized, and fed to the W8A16 Triton kernel."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor,
                 segments: list[Segment], device: torch.device) -> None:
        self.weight = weight.to(device).contiguous()
        self.scale = scale.to(device)
        self.segments = [(a, b, None if s is None else s.to(device)) for a, b, s in segments]
        self.cuda = use_triton(device)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        parts = []
        for start, end, static in self.segments:
            xq, xs = quant_int8_ref(x2, static)
            w, ws = self.weight[start:end], self.scale[start:end]
            if self.cuda:
                from edgellm.kernels.dequant_gemm import w8a16_gemm

                parts.append(w8a16_gemm((xq.float() * xs).to(x.dtype), w, ws[:, None]).float())
            elif x2.shape[0]:
                parts.append(torch._int_mm(xq, w.t()).float() * xs * ws)
            else:
                parts.append(x2.new_zeros((0, end - start), dtype=torch.float32))
        y = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class Int8WeightOnlyKernel:
    """W8A16: CUDA the Triton kernel; CPU the dequantized weight (exact)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        self.cuda = use_triton(device)
        if self.cuda:
            self.weight, self.scale = weight.to(device), scale.to(device)[:, None]
        else:
            self.dense = (weight.float() * scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.cuda:
            from edgellm.kernels.dequant_gemm import w8a16_gemm

            return w8a16_gemm(x, self.weight, self.scale, bias)
        return F.linear(x, self.dense, bias)


class FP8Kernel:
    """CUDA: the FP8 Triton GEMM (W8A8 on sm89+, weight-only dequant elsewhere), per
    input-scale segment. CPU: the weight dequantized once (exact, fp32), activations
    quantized to fp8 and back exactly as the W8A8 kernel does."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, segments: list[Segment],
                 activations: str | None, device: torch.device, dtype: torch.dtype) -> None:
        self.cuda = use_triton(device)
        self.activations = activations  # None (weight-only) | "token" | "tensor"
        self.segments = [(a, b, None if s is None else s.to(device)) for a, b, s in segments]
        if self.cuda:
            self.weight = weight.to(device)
            self.scale = scale.to(device)[:, None]
        else:
            self.dense = (weight.float() * scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.fp8_gemm import (
            fp8_activations_supported,
            fp8_gemm,
            quant_fp8_per_token_ref,
        )
        from edgellm.kernels.gemm_common import interpreting

        x2 = x.reshape(-1, x.shape[-1])
        parts = []
        # W8A8 where the GPU has fp8 (sm89+) or under the interpreter; weight-only elsewhere
        act_fp8 = self.activations is not None and (fp8_activations_supported(x.device) or interpreting())
        for start, end, static in self.segments:
            b = None if bias is None else bias[start:end]
            if self.cuda:
                parts.append(fp8_gemm(x2, self.weight[start:end], self.scale[start:end], static, b,
                                      use_fp8_activations=act_fp8))
                continue
            xa = x2
            if self.activations is not None:
                xq, xs = quant_fp8_per_token_ref(x2, static)
                xa = (xq.float() * xs).to(x.dtype)
            parts.append(F.linear(xa, self.dense[start:end], b))
        y = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        return y.reshape(*x.shape[:-1], y.shape[-1])
