"""CPU mode auto: the logits head for rows that need nothing but their argmax, by integer dots.

The head is the largest matrix of a small model (SmolLM2's tied 49152 x 576 embedding is 113 MB
in fp32, more than all its int4 layers), so a greedy decode step reads it as int8 (a scale per 32
columns of each vocabulary row, GGUF's Q8_0 blocks: 30 MB, and a Q8_0 head's own codes exactly)
times int8-quantized activations (edgellm/kernels/csrc/cpu/qgemm_n16.h, bits 8).
Rows that sample at a temperature (no logprobs) take the int8 products alone: every logit within
the window below, the order of the int8 layers' own noise. For argmax rows the argmax stays the
fp32 head's, as in
edgellm/quant/linear_kernels/cpu_fast_head.CpuFastLogitsHead: every token whose
approximate logit is within twice the error bound of the row's maximum is recomputed in fp32.
The bound: the dot product's error sum_k x_k e_k + d_k w_k (e: the weight's int8 rounding, known
at load; d = x - dequantized int8 x, known per step) is a sum of K terms of mixed sign with
standard deviation sigma = sqrt(|x|^2 ms(e) + |d|^2 ms(w)) (ms: the largest mean square over the
vocabulary rows); SIGMAS standard deviations of it, plus fp32 summation noise. approximate() is
the plain statement of that; a step runs all of it and the recheck in one C++ call.
"""

from __future__ import annotations

from typing import Any

import torch

from edgellm.quant.linear_kernels.cpu_fast_head import CpuFastLogitsHead

_NO_MASK = torch.empty(0, dtype=torch.int32)


class IntDotLogitsHead(CpuFastLogitsHead):
    """n16: the codes in the interleaved layout (qgemm_n16.h; CpuIsa.n16), whose steps of
    `amx_rows` rows or more run on AMX tiles where the CPU has them (calibrate())."""

    # The C++ recheck reads each candidate's fp32 row in place, in parallel: its cost grows with
    # the candidates, so a flat row is never recomputed whole. (Gemma 3 270M, 262144 x 640: a row
    # with 2624 candidates took 5.4 ms so, and 62 ms recomputed whole.)
    MAX_CANDIDATES = 1 << 62

    GROUP = 32  # columns per weight scale: GGUF Q8_0 blocks, so a Q8_0 head keeps its codes

    def __init__(self, weight: torch.Tensor, native: Any, n16: bool = False) -> None:
        from edgellm.kernels.reference import pack_int_n16_ref, tile_n16_ref
        from edgellm.quant.linear_kernels.cpu_int_storage import fp16_if_exact

        w = weight.float()
        v, k = w.shape
        blocks = w.view(v, k // self.GROUP, self.GROUP)
        scale = (blocks.abs().amax(-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # [V, G]
        codes = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(v, k)
        self.w_ms = float(w.square().mean(1).max())
        deq = (codes.view(v, -1, self.GROUP).float() * scale[..., None]).view(v, k)
        self.err_ms = float((w - deq).square().mean(1).max())
        scale = fp16_if_exact(scale)  # a Q8_0 head's steps are fp16 values: half the bytes
        self.n16 = n16
        self.codes = pack_int_n16_ref(codes.contiguous(), 8) if n16 else codes.contiguous()
        self.scale = tile_n16_ref(scale) if n16 else scale.contiguous()
        self.amx_rows = 1 << 62
        self.k = k
        self.native = native
        self.weight = weight  # the model's own (tied) matrix: no copy

    def int_dot(self, x: torch.Tensor, amx_rows: int | None = None) -> torch.Tensor:
        """The int8 products [M, V] alone (no window, no recheck)."""
        if self.n16:
            return self.native.int_linear_n16(
                x,
                self.codes,
                self.scale,
                torch.empty(0),
                8,
                self.GROUP,
                torch.empty(0),
                self.weight.shape[0],
                self.amx_rows if amx_rows is None else amx_rows,
            )
        return self.native.int_linear(
            x, self.codes, self.scale, torch.empty(0), 8, self.GROUP, torch.empty(0)
        )

    def calibrate(self, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> int | None:
        """n16 on a host that runs AMX tiles: set amx_rows to the smallest of `rows` from which the
        tiles were faster than VNNI at every size measured (fresh random activations)."""
        if not self.n16 or not self.native.amx_ready():
            return None
        from edgellm.quant.linear_kernels.cpu_int import _time

        never = 1 << 62
        wins = []
        with torch.inference_mode():
            for r in rows:
                x = torch.randn(r, self.k)
                wins.append(
                    _time(lambda x=x: self.int_dot(x, 0))
                    < _time(lambda x=x: self.int_dot(x, never))
                )
        start = next((i for i in range(len(wins)) if all(wins[i:])), None)
        self.amx_rows = never if start is None else rows[start]
        return None if start is None else rows[start]

    @classmethod
    def can_implement(cls, weight: torch.Tensor) -> bool:
        return (
            weight.dtype == torch.float32
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_contiguous()
        )

    def approximate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(approximate fp32 logits [M, V], each row's max [M, 1], the window half-width [M, 1])."""
        x = x.contiguous()
        logits = self.int_dot(x)
        codes, d, _ = self.native.quantize_rows(x, self.k)
        err = x - (codes.float().view(x.shape[0], -1, 32) * d[..., None]).view_as(x)
        sigma = (
            x.square().sum(-1, keepdim=True) * self.err_ms
            + err.square().sum(-1, keepdim=True) * self.w_ms
        ).sqrt()
        hi, lo = logits.amax(-1, keepdim=True), logits.amin(-1, keepdim=True)
        return logits, hi, self.SIGMAS * sigma + torch.maximum(hi, -lo) * 1e-5

    def sampling_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every logit of fp32 rows x [M, K] by the int8 products alone (no window, no recheck)."""
        return self.int_dot(x.contiguous())

    def _approx(self, x: torch.Tensor) -> torch.Tensor:
        """approximate() and the fp32 recheck of the window's tokens, in one C++ call
        (edgellm/kernels/csrc/cpu/logits_head.cpp; a row over MAX_CANDIDATES is recomputed
        whole)."""
        return self._argmax_logits(x, _NO_MASK)

    def _argmax_logits(self, x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        return self.native.int8_argmax_logits(
            x.contiguous(),
            self.codes,
            self.scale,
            self.weight,
            self.w_ms,
            self.err_ms,
            self.SIGMAS,
            self.MAX_CANDIDATES,
            bitmask,
            self.amx_rows,
        )

    def masked(self, x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] for greedy rows under a grammar, bitmask int32 [M, ceil(V / 32)] (bit j of
        word i: token 32 i + j, set = allowed; xgrammar's layout): as masked_ref, in one C++ call
        that reads the bitmask words as they are."""
        return self._argmax_logits(x, bitmask.to(torch.int32).contiguous())

    def masked_ref(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] for greedy rows under a grammar: -inf where allowed [M, V] (bool) is False,
        and exact fp32 for every allowed token within twice the window of the allowed maximum, so
        the masked argmax is the fp32 head's. The other allowed logits stay approximate and
        below."""
        logits, _, half = self.approximate(x)
        logits = logits.masked_fill(~allowed, float("-inf"))
        top = logits.amax(-1, keepdim=True)
        cand = logits >= top - 2 * half
        for i in range(x.shape[0]):
            idx = cand[i].nonzero().flatten()
            if idx.numel() > self.MAX_CANDIDATES:
                row = torch.mv(self.weight, x[i])
                logits[i] = row.masked_fill(~allowed[i], float("-inf"))
            else:
                logits[i, idx] = torch.mv(self.weight.index_select(0, idx), x[i])
        return logits
