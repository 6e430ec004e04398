"""Write quantized linears and quantization_config the way the community tools do,
and read them back to float (the check that what is on disk is what was meant).

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

CT_VERSION = "0.19.0"  # the compressed-tensors format version these files match (fixtures)
EDGELLM_QUANTIZER = "edgellm:0.1.0"


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


# -- quantization_config ------------------------------------------------------------


def _ct_args(
    num_bits: int,
    type_: str,
    strategy: str,
    symmetric: bool = True,
    group_size: int | None = None,
    dynamic: bool = False,
    actorder: str | None = None,
    observer: str | None = "memoryless_minmax",
) -> dict[str, Any]:
    return {
        "actorder": actorder,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": group_size,
        "num_bits": num_bits,
        "observer": observer,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": strategy,
        "symmetric": symmetric,
        "type": type_,
        "zp_dtype": None if symmetric else "torch.int8",
    }


def ct_format(scheme: Scheme) -> str:
    if scheme.kind == "fp8":
        return "float-quantized"
    return "int-quantized" if scheme.activations else "pack-quantized"


def ct_quantization_config(scheme: Scheme, ignore: list[str], kv_cache_fp8: bool) -> dict[str, Any]:
    fmt = ct_format(scheme)
    actorder = "static" if scheme.actorder == "static" else scheme.actorder
    if scheme.kind == "fp8":
        strategy = "channel" if scheme.fp8_per_channel else "tensor"
        weights = _ct_args(8, "float", strategy)
        if scheme.activations == "fp8-static":
            inputs = _ct_args(8, "float", "tensor", observer="static_minmax")
        else:
            inputs = _ct_args(8, "float", "token", dynamic=True, observer=None)
    else:
        if scheme.group_size > 0:
            weights = _ct_args(
                scheme.bits, "int", "group", scheme.symmetric, scheme.group_size, actorder=actorder
            )
        else:
            weights = _ct_args(scheme.bits, "int", "channel", scheme.symmetric, actorder=actorder)
        inputs = (
            _ct_args(8, "int", "token", dynamic=True, observer=None)
            if scheme.activations == "int8-token"
            else None
        )
    kv = None
    if kv_cache_fp8:
        kv = _ct_args(8, "float", "tensor", observer="static_minmax")
    return {
        "config_groups": {
            "group_0": {
                "format": fmt,
                "input_activations": inputs,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": kv,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def awq_quantization_config(scheme: Scheme, extra_ignore: list[str]) -> dict[str, Any]:
    return {
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "modules_to_not_convert": list(extra_ignore) or None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }


def gptq_quantization_config(scheme: Scheme, damp: float) -> dict[str, Any]:
    """GPTQModel's keys (quantize_config.json and config.json carry the same dict)."""
    return {
        "bits": scheme.bits,
        "checkpoint_format": "gptq",
        "desc_act": scheme.actorder == "group",
        "format": "gptq",
        "group_size": scheme.group_size,
        "lm_head": False,
        "meta": {
            "act_group_aware": scheme.actorder == "static",
            "auto_forward_data_parallel": False,
            "damp_auto_increment": 0.01,
            "damp_percent": damp,
            "dense_vram_strategy": "exclusive",
            "dense_vram_strategy_devices": None,
            "fallback": {"smooth": None, "strategy": None, "threshold": None},
            "foem": None,
            "gc_mode": "interval",
            "gptaq": None,
            "hessian": {
                "chunk_bytes": None,
                "chunk_size": None,
                "dedup_shared_inputs": True,
                "staging_dtype": "float32",
            },
            "mock_quantization": False,
            "moe_vram_strategy": "exclusive",
            "moe_vram_strategy_devices": None,
            "mse": 0.0,
            "offload_to_disk": False,
            "offload_to_disk_path": None,
            "pack_impl": "torch",
            "quantizer": [EDGELLM_QUANTIZER],
            "static_groups": False,
            "telemetry": {"device": False},
            "true_sequential": False,
            "uri": "https://github.com/edgellm/edgellm",
            "wait_for_submodule_finalizers": False,
        },
        "method": "gptq",
        "pack_dtype": "int32",
        "quant_method": "gptq",
        "sym": scheme.symmetric,
    }


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
    "ct_quantization_config",
    "awq_quantization_config",
    "gptq_quantization_config",
    "linear_tensors",
    "dequantize_module",
    "pack_int8_words",
    "unpack_int8_words",
    "pack_int4",
]
