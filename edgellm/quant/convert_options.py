"""What one `edgellm convert` run is asked to do, and whether it can.

SCHEMES: the named schemes (`rtn` an alias of w4a16-rtn). ConvertOptions: every option of
a run. resolve_scheme applies the options to the scheme and rejects combinations the
output format cannot hold; out_dtype picks the dtype of the written scales and floats;
check_shapes checks every dimension constraint of the model's linears before any work.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from edgellm.quant.convert_source import ConvertError
from edgellm.quant.export import Scheme

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w4a16-gptq", "int", "gptq", 4, True, 128, actorder="static"),
        Scheme("w4a16-awq", "int", "awq", 4, False, 128),
        Scheme("w4a16-rtn", "int", "rtn", 4, True, 128),
        Scheme(
            "w8a8-int8", "int", "smoothquant+gptq", 8, True, -1, "int8-token", actorder="static"
        ),
        Scheme("w8a16-int8", "int", "gptq", 8, True, -1, actorder="static"),
        Scheme("fp8-dynamic", "fp8", "minmax", 8, True, -1, "fp8-token", fp8_per_channel=True),
        Scheme("fp8-static", "fp8", "minmax", 8, True, -1, "fp8-static", fp8_per_channel=False),
    )
}
SCHEME_ALIASES = {"rtn": "w4a16-rtn"}
DEFAULT_NUM_SAMPLES = 64
DEFAULT_SEQ_LEN = 256


@dataclasses.dataclass
class ConvertOptions:
    src: str
    out: str
    scheme: str
    calib: str | None = None
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    group_size: int | None = None
    symmetric: bool | None = None
    actorder: str | None = "default"  # "default" | None | "static" | "group"
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache_dtype: str = "auto"
    format: str = "compressed-tensors"
    force: bool = False
    dtype: str = "auto"
    damp: float = 0.01
    smoothing_strength: float = 0.8
    awq_grid: int = 20
    awq_duo_scaling: bool = False
    evaluate: bool = True
    eval_samples: int = 16
    batch_size: int = 8
    seed: int = 0


def resolve_scheme(opts: ConvertOptions) -> Scheme:
    name = SCHEME_ALIASES.get(opts.scheme, opts.scheme)
    if name not in SCHEMES:
        raise ConvertError(
            f"unsupported scheme {opts.scheme!r}; choose one of {', '.join(SCHEMES)}, rtn"
        )
    s = SCHEMES[name]
    changes: dict[str, Any] = {}
    if opts.group_size is not None:
        if s.kind == "fp8" or s.activations == "int8-token":
            raise ConvertError(f"--group-size does not apply to {name} (per-channel/tensor scales)")
        if opts.group_size == 0 or opts.group_size < -1:
            raise ConvertError(
                "--group-size must be positive, or -1 for one scale per output channel"
            )
        changes["group_size"] = opts.group_size
    if opts.symmetric is not None:
        if s.kind == "fp8" or s.activations:
            raise ConvertError(f"--sym/--asym does not apply to {name}")
        changes["symmetric"] = opts.symmetric
    if opts.actorder != "default":
        if s.algorithm not in ("gptq", "smoothquant+gptq"):
            raise ConvertError("--actorder only applies to GPTQ schemes")
        changes["actorder"] = opts.actorder
    s = dataclasses.replace(s, **changes)
    if opts.format not in ("compressed-tensors", "awq", "gptq"):
        raise ConvertError(f"unknown --format {opts.format!r} (compressed-tensors, awq, gptq)")
    if opts.format != "compressed-tensors":
        if s.kind != "int" or s.bits != 4:
            raise ConvertError(
                f"--format {opts.format} holds int4 weights only; {name} is not int4"
            )
        if opts.kv_cache_dtype == "fp8":
            raise ConvertError(
                f"--kv-cache-dtype fp8 needs the compressed-tensors format, not {opts.format}"
            )
        if opts.format == "awq":
            if s.symmetric and opts.symmetric is not None:
                raise ConvertError("--format awq is always asymmetric (zero_point); drop --sym")
            if s.actorder == "group":
                raise ConvertError("--format awq cannot hold act-order (g_idx)")
            s = dataclasses.replace(s, symmetric=False)
        if s.group_size <= 0:
            raise ConvertError(f"--format {opts.format} needs a positive --group-size")
    if opts.format == "compressed-tensors" and s.actorder == "group":
        raise ConvertError(
            "--actorder group (g_idx) is not loadable as compressed-tensors (removed in 0.20); "
            "use --actorder static, or --format gptq (desc_act)"
        )
    if opts.kv_cache_dtype not in ("auto", "fp8"):
        raise ConvertError("--kv-cache-dtype must be auto or fp8")
    if opts.num_samples < 1 or opts.seq_len < 8:
        raise ConvertError("--num-samples must be >= 1 and --seq-len >= 8")
    return s


def out_dtype(opts: ConvertOptions, config: dict[str, Any]) -> torch.dtype:
    if opts.format != "compressed-tensors":
        return torch.float16  # AutoAWQ / GPTQ kernels read fp16 scales
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    if opts.dtype != "auto":
        if opts.dtype not in table:
            raise ConvertError("--dtype must be auto, float16 or bfloat16")
        return table[opts.dtype]
    src = str(config.get("dtype") or config.get("torch_dtype") or "float16")
    return table.get(src, torch.float16)


def matches_ignore(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or name.rsplit(".", 1)[-1] == p:
            return True
    return False


def check_shapes(linears: dict[str, nn.Linear], scheme: Scheme, fmt: str) -> None:
    """Every dimension constraint, checked before any work, one line each."""
    for name, lin in linears.items():
        n, k = lin.out_features, lin.in_features
        if scheme.kind == "int" and scheme.group_size > 0 and k % scheme.group_size:
            divisors = [g for g in (256, 128, 64, 32, 16) if k % g == 0]
            raise ConvertError(
                f"group size {scheme.group_size} does not divide the input dim {k} of {name}"
                + (f" (try --group-size {divisors[0]})" if divisors else "")
            )
        if scheme.kind == "int" and scheme.bits == 4 and k % 8:
            raise ConvertError(f"{name}: input dim {k} is not a multiple of 8 (int4 packing)")
        if scheme.kind == "int" and scheme.bits == 8 and not scheme.activations and k % 4:
            raise ConvertError(f"{name}: input dim {k} is not a multiple of 4 (int8 packing)")
        if (fmt in ("awq", "gptq") or not scheme.symmetric) and n % 8:
            raise ConvertError(
                f"{name}: output dim {n} is not a multiple of 8 (packed zero points)"
            )
