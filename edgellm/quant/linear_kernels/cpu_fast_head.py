"""CPU mode "fast": the logits head for rows that need only their argmax, exact on the argmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgellm.quant.linear_kernels.onednn import bf16_linear, pack_bf16


class CpuFastLogitsHead:
    """CPU "fast": the logits projection for rows that need nothing but their argmax (greedy, no
    penalties, no logprobs; the engine decides). It is the largest matrix of a small model
    (SmolLM2's tied 49152 x 576 embedding is 113 MB in fp32, more than all its int4 layers).
    Up to int8_max_rows such rows read it as int8 per output row through torch's int8 GEMV
    (`_weight_int8pack_mm`, 28 MB); more rows use a bf16 copy on the bf16 matrix units (its cost
    is flat in rows). Rows that sample at a temperature take the approximate product alone;
    every other row (logprobs, prompt logits) takes the fp32 weight.

    The argmax stays the fp32 head's: each approximate logit is within B of the fp32 one (weight
    rounding, bf16 activations, bf16 output; bound() below: 8 standard deviations of the rounding
    noise), so only tokens whose approximate logit is within 2B of the row's maximum can hold the
    true maximum. Those
    candidates are recomputed in fp32 from the full-precision rows and written back; the other
    logits stay approximate and below them. When a row has more than MAX_CANDIDATES candidates
    (a flat distribution) it is recomputed whole in fp32."""

    masked = None  # (x, allowed) -> logits exact on the masked argmax; see IntDotLogitsHead.masked
    MAX_CANDIDATES = 2048
    SIGMAS = 8.0

    def __init__(self, weight: torch.Tensor, packed_bf16: bool) -> None:
        # rows up to which the int8 GEMV runs; beyond, the bf16 copy (oneDNN's blocked layout is
        # flat in rows from 1, the plain one is not)
        self.int8_max_rows = 2 if packed_bf16 else 4
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
        self.bf16 = pack_bf16(bf16, packed_bf16)
        self.weight = weight  # the model's own (tied) matrix: no copy

    def __call__(
        self,
        x: torch.Tensor,
        argmax_only: list[bool] | None = None,
        sampling: list[bool] | None = None,
    ) -> torch.Tensor:
        """argmax_only: per row, whether only its argmax is needed (None: all rows). sampling: per
        row, whether its logits only feed a sampler at a temperature (no logprobs): those take the
        approximate product alone (`sampling_logits`), every logit within the window `approximate`
        bounds, the order of the int8 layers' own noise in this mode. The other rows take the fp32
        weight."""
        rows = x.shape[0]
        argmax = (
            set(range(rows)) if argmax_only is None else {i for i, a in enumerate(argmax_only) if a}
        )
        approx = {i for i, s in enumerate(sampling or []) if s} - argmax
        if x.dtype != torch.float32 or not (argmax or approx):
            return F.linear(x, self.weight).float()
        if len(argmax) == rows:
            return self._approx(x)
        if len(approx) == rows:
            return self.sampling_logits(x)
        if len(argmax) + len(approx) < rows:  # rows that need every logit exactly
            out = F.linear(x, self.weight).float()
        else:
            out = torch.empty(rows, self.weight.shape[0], dtype=torch.float32)
        for idx, run in ((argmax, self._approx), (approx, self.sampling_logits)):
            if idx:
                t = torch.tensor(sorted(idx))
                out[t] = run(x[t])
        return out

    def sampling_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every logit of fp32 rows x [M, K] by the approximate product (no window, no recheck)."""
        return self._product(x)[2]

    def bound(
        self, x: torch.Tensor, xb: torch.Tensor, top: torch.Tensor, int8: bool
    ) -> torch.Tensor:
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
        sigma = (
            x.square().sum(-1, keepdim=True) * ms_e + d.square().sum(-1, keepdim=True) * self.w_ms
        ).sqrt()
        return self.SIGMAS * sigma + top * (1 / 256)

    def approximate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(approximate fp32 logits [M, V], each row's max [M, 1], the window half-width [M, 1]),
        before any refinement."""
        xb, int8, logits = self._product(x)
        hi, lo = logits.amax(-1, keepdim=True), logits.amin(-1, keepdim=True)
        return logits, hi, self.bound(x, xb, torch.maximum(hi, -lo), int8)

    def _product(self, x: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """(x in bf16, whether the int8 GEMV ran (else the bf16 copy), the logits [M, V] fp32)."""
        xb = x.to(torch.bfloat16)
        int8 = x.shape[0] <= self.int8_max_rows
        if int8:
            return xb, int8, torch._weight_int8pack_mm(xb, self.codes, self.scales).float()
        return xb, int8, bf16_linear(xb, self.bf16).float()

    def _approx(self, x: torch.Tensor) -> torch.Tensor:
        logits, hi, bound = self.approximate(x)
        floor = hi - 2 * bound
        rows, cols = (logits >= floor).nonzero(as_tuple=True)
        # a row over MAX_CANDIDATES (only possible when the total is) is recomputed whole
        if (
            rows.numel() > self.MAX_CANDIDATES
            and int(torch.bincount(rows).max()) > self.MAX_CANDIDATES
        ):
            return F.linear(x, self.weight).float()
        logits[rows, cols] = (x[rows] * self.weight[cols]).sum(-1)
        return logits
