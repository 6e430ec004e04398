"""quantization_config as the community tools write it, for what `edgellm convert` makes.

compressed-tensors (llm-compressor 0.14 / compressed-tensors 0.19, checked key by key
against ../shared/fixtures: config_groups, ignore, kv_cache_scheme), AutoAWQ "gemm", and
GPTQModel's GPTQ v1 (the same dict in config.json and quantize_config.json).
"""

from __future__ import annotations

from typing import Any

from edgellm.quant.export import Scheme

CT_VERSION = "0.19.0"  # the compressed-tensors format version these files match (fixtures)
EDGELLM_QUANTIZER = "edgellm:0.1.0"


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
