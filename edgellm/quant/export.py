"""Write quantized linears the way the community tools do, and read them back to float
(the check that what is on disk is what was meant). Scheme: what `edgellm convert --scheme`
makes. The quantization_config dicts are edgellm/quant/export_config.py's.

compressed-tensors (llm-compressor 0.14 / compressed-tensors 0.19, checked key
by key against ../shared/fixtures):
  pack-quantized   weight_packed int32 [N, K*b/32] (value + 2^(b-1), low bits first),
                   weight_scale [N, G], weight_shape int64 [2],
                   weight_zero_point int32 [N*b/32, G] when asymmetric,
                   weight_g_idx int32 [K] with actorder "group"
  int-quantized    weight int8 [N, K], weight_scale [N, 1]
  float-quantized  weight float8_e4m3fn [N, K], weight_scale [N, 1] or [1] (+ input_scale [1])
  kv cache         <layer>.self_attn.k_scale / v_scale [1] and quantization_config.kv_cache_scheme
AutoAWQ "gemm" and GPTQ v1 go through the exact packers in edgellm/kernels/int4_layouts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgellm.kernels.int4_layouts import (
    pack_awq,
    pack_ct_int4,
    pack_gptq,
    pack_int4,
    unpack_awq,
    unpack_ct_int4,
    unpack_gptq,
    unpack_int4,
)
from edgellm.quant.qparams import FP8Weight, IntWeight


@dataclass(frozen=True)
class Scheme:
    """What `edgellm convert --scheme` makes."""

    name: str
    kind: str  # "int" | "fp8"
    algorithm: str  # "gptq" | "awq" | "rtn" | "smoothquant+gptq" | "minmax"
    bits: int = 4
    symmetric: bool = True
    group_size: int = 128  # -1: one scale per output channel
    activations: str | None = None  # None | "int8-token" | "fp8-token" | "fp8-static"
    fp8_per_channel: bool = True
    actorder: str | None = None  # None | "static" | "group"

    @property
    def needs_calibration(self) -> bool:
        return self.algorithm != "rtn" and not (
            self.kind == "fp8" and self.activations != "fp8-static"
        )


# -- 8-bit packing (compressed-tensors pack-quantized, num_bits 8) ------------------


def pack_int8_words(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned byte codes -> int32, 4 per word along `dim`, element 4j+i in byte i."""
    c = codes.movedim(dim, -1).to(torch.int32)
    if c.shape[-1] % 4:
        raise ValueError(f"packed dim must be a multiple of 4, got {c.shape[-1]}")
    c = c.reshape(*c.shape[:-1], -1, 4)
    word = c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16) | (c[..., 3] << 24)
    return word.movedim(-1, dim).contiguous()


def unpack_int8_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    w = words.movedim(dim, -1).to(torch.int32)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    c = (w[..., None] >> shifts) & 0xFF
    return c.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


# -- tensors --------------------------------------------------------------------------


def linear_tensors(
    qw: IntWeight | FP8Weight, fmt: str, scheme: Scheme, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One quantized linear's tensors (names relative to the module)."""
    if isinstance(qw, FP8Weight):
        out = {"weight": qw.weight.contiguous(), "weight_scale": qw.scale.to(dtype)}
        if qw.input_scale is not None:
            out["input_scale"] = qw.input_scale.to(dtype)
        return out
    scales = qw.scales.to(dtype)
    if fmt == "awq":
        if qw.zeros is None or qw.g_idx is not None:
            raise ValueError("AWQ gemm needs asymmetric quantization without act-order")
        return pack_awq(qw.codes, qw.zeros, scales)
    if fmt == "gptq":
        return pack_gptq(qw.codes, qw.zeros, scales, qw.spec.group_len(qw.codes.shape[1]), qw.g_idx)
    # compressed-tensors
    if scheme.activations == "int8-token":
        return {"weight": (qw.codes - qw.spec.mid).to(torch.int8), "weight_scale": scales}
    if qw.spec.bits == 4:
        out = pack_ct_int4(qw.codes, scales, qw.zeros)
    elif qw.spec.bits == 8:
        out = {
            "weight_packed": pack_int8_words(qw.codes, 1),
            "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor(list(qw.codes.shape), dtype=torch.int64),
        }
        if qw.zeros is not None:
            out["weight_zero_point"] = pack_int8_words(qw.zeros, 0)
    else:
        raise ValueError(f"{qw.spec.bits}-bit weights are not written")
    if qw.g_idx is not None:
        out["weight_g_idx"] = qw.g_idx.to(torch.int32)
    return out


# -- reading back ---------------------------------------------------------------------


def dequantize_module(tensors: dict[str, torch.Tensor], qc: dict[str, Any]) -> torch.Tensor | None:
    """A quantized module's on-disk tensors -> float32 weight [N, K]; None if it is not
    quantized."""
    method = qc.get("quant_method")
    if method == "awq":
        if "qweight" not in tensors:
            return None
        return unpack_awq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], qc["group_size"]
        )
    if method == "gptq":
        if "qweight" not in tensors:
            return None
        gs = qc["group_size"] if qc["group_size"] > 0 else tensors["qweight"].shape[0] * 8
        return unpack_gptq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"), gs
        )
    if method != "compressed-tensors":
        raise ValueError(f"cannot read back quant_method {method!r}")
    weights = qc["config_groups"]["group_0"]["weights"]
    if "weight_packed" in tensors:
        bits = int(weights["num_bits"])
        scale = tensors["weight_scale"].float()
        g_idx = tensors.get("weight_g_idx")
        if bits == 4:
            return unpack_ct_int4(
                tensors["weight_packed"], scale, tensors.get("weight_zero_point"), None, g_idx
            )
        codes = unpack_int8_words(tensors["weight_packed"], 1)
        n, k = codes.shape
        zp = tensors.get("weight_zero_point")
        z = torch.full_like(scale, 128.0) if zp is None else unpack_int8_words(zp, 0)[:n].float()
        gidx = g_idx.long() if g_idx is not None else torch.arange(k) // (k // scale.shape[1])
        return (codes.float() - z[:, gidx]) * scale[:, gidx]
    if "weight_scale" in tensors and "weight" in tensors:
        return tensors["weight"].float() * tensors["weight_scale"].float()
    return None


def unpacked_int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors weight_packed -> codes (for tests)."""
    return unpack_int4(packed, 1)


__all__ = [
    "Scheme",
    "linear_tensors",
    "dequantize_module",
    "pack_int8_words",
    "unpack_int8_words",
    "pack_int4",
]
