"""Rotary position embedding (neox style, optionally partial) with the scaling
variants of the supported families: linear, llama3, longrope (Phi-3), yarn, and GGUF's
per-frequency divisors (freq_factors, how llama.cpp stores llama3-style scaling).

cos/sin are precomputed in float32 for every position exactly as transformers
computes them (inv_freq * position, then cos/sin, then the attention factor),
so the rotation is bit-identical to the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or max_pos
    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, float(attention_factor)


def _table(inv_freq: torch.Tensor, num_positions: int, scale: float) -> torch.Tensor:
    """[num_positions, rot_dim] cos then sin halves concatenated: [cos(rot_dim) | sin(rot_dim)]."""
    pos = torch.arange(num_positions, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cat((emb.cos() * scale, emb.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by token position; q/k are [tokens, heads, head_dim]."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        partial_rotary_factor: float = 1.0,
        max_position_embeddings: int | None = None,
    ) -> None:
        """max_position: table size (positions served); max_position_embeddings: the model's
        own limit, which longrope and yarn derive their scaling from."""
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * partial_rotary_factor)
        self.max_position = max_position
        model_max = max_position_embeddings or max_position
        rope_type = (scaling or {}).get("rope_type", "default")
        self.long_threshold: int | None = None  # longrope: sequences longer use the long table
        scale = 1.0
        inv = _inv_freq(theta, self.rot_dim)
        long_table = None
        if rope_type == "linear":
            inv = inv / scaling["factor"]  # type: ignore[index]
        elif rope_type == "llama3":
            inv = _llama3(inv, scaling)  # type: ignore[arg-type]
        elif rope_type == "freq_factors":  # GGUF's rope_freqs: each frequency divided by its factor
            factors = torch.tensor(scaling["factors"], dtype=torch.float32)  # type: ignore[index]
            if factors.numel() != inv.numel():
                raise ValueError(
                    f"rope freq factors: {factors.numel()} for {inv.numel()} frequencies"
                )
            inv = inv / factors
        elif rope_type == "yarn":
            inv, scale = _yarn(theta, self.rot_dim, scaling, model_max)  # type: ignore[arg-type]
        elif rope_type == "longrope":
            assert scaling is not None
            orig = int(scaling["original_max_position_embeddings"])
            factor = scaling.get("factor") or model_max / orig
            scale = scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            )
            exps = torch.arange(0, self.rot_dim, 2, dtype=torch.int64).float() / self.rot_dim
            short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
            long = torch.tensor(scaling["long_factor"], dtype=torch.float32)
            inv = 1.0 / (short * theta**exps)
            long_table = _table(1.0 / (long * theta**exps), max_position, scale)
            self.long_threshold = orig
        table = _table(inv, max_position, scale)
        if long_table is not None:
            table = torch.cat((table, long_table), dim=0)
        self.register_buffer("cos_sin", table, persistent=False)

    def cos_sin_for(
        self, positions: torch.Tensor, seq_total_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot_dim] for a step's tokens (computed once, shared by all layers)."""
        index = positions
        if self.long_threshold is not None and seq_total_lens is not None:
            # Phi-3 longrope: a sequence longer than the pretraining length uses the long factors
            # for all its tokens, as transformers does for the whole forward pass.
            index = positions + (seq_total_lens > self.long_threshold).long() * self.max_position
        cos, sin = self.cos_sin[index].to(dtype).chunk(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by their positions' cos/sin."""
        return _rotate(q, cos, sin, self.rot_dim), _rotate(k, cos, sin, self.rot_dim)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (q and k heads side by side) rotated by their positions' cos/sin."""
        return _rotate(x, cos, sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    if rot_dim == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)
