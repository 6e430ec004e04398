"""compressed-tensors checkpoints (llm-compressor): `pack-quantized` int4 (and int8,
W8A16), `int-quantized` int8 (W8A8 or weight-only) and `float-quantized` FP8.

For a linear with N outputs, K inputs, group g (README of the fixtures):
  pack-quantized   weight_packed int32 [N, K/8] along K (codes = q + 8); weight_scale
                   [N, K/g]; weight_shape int64 [2]; asymmetric: weight_zero_point int32
                   [N/8, K/g] along N (+8); actorder "group": weight_g_idx [K]
  int-quantized    weight int8 [N, K]; weight_scale [N, 1] (channel) or [1] (tensor)
  float-quantized  weight float8_e4m3fn [N, K]; weight_scale as above
  activations      dynamic per token (nothing on disk) or static per tensor (input_scale [1])
The output dim is dim 0. Per-tensor scales of fused shards are kept per shard:
weight scales are expanded to per-channel (exact); shards with different static
input scales quantize the activations once per shard (exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgellm.kernels.int4_layouts import unpack_int4
from edgellm.quant.linear_kernels.w8a8 import FP8Kernel, Int8W8A8Kernel, Int8WeightOnlyKernel
from edgellm.quant.schemes import (
    Int4Codes,
    LinearMethod,
    ParamLayout,
    QuantLinearMethod,
    QuantScheme,
    UnquantizedLinearMethod,
    common_g_idx,
    config_error,
    dequantize_g_idx,
    empty_param,
    free_params,
    matches_any,
    shard_g_idx,
    shard_ranges,
    stashed,
)


@dataclass(frozen=True)
class _Group:
    """One config group: which linears it targets and how they are stored."""

    targets: tuple[str, ...]
    format: str
    num_bits: int
    symmetric: bool
    strategy: str  # "group" | "channel" | "tensor"
    group_size: int | None
    has_g_idx: bool
    activations: (
        str | None
    )  # None (weight-only) | "token" (dynamic) | "tensor" (static input_scale)

    def targets_linear(self, name: str) -> bool:
        return "Linear" in self.targets or matches_any(name, self.targets)


def _parse_group(
    name: str, group: dict[str, Any], top_format: str | None, config: dict[str, Any]
) -> _Group:
    fmt = group.get("format") or top_format
    w = group.get("weights")
    if not w:
        raise config_error(
            "compressed-tensors", f"group {name!r} without weight quantization", config
        )
    if group.get("output_activations"):
        raise config_error(
            "compressed-tensors", f"group {name!r}: output activation quantization", config
        )
    wtype, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    if w.get("dynamic"):
        raise config_error(
            "compressed-tensors", f"group {name!r}: dynamic weight quantization", config
        )
    expected = {
        "pack-quantized": (("int", 4), ("int", 8)),
        "int-quantized": (("int", 8),),
        "float-quantized": (("float", 8),),
    }
    if fmt not in expected:
        raise config_error(
            "compressed-tensors", f"format {fmt!r} (supported: {', '.join(expected)})", config
        )
    if (wtype, bits) not in expected[fmt]:
        raise config_error(
            "compressed-tensors", f"group {name!r}: {bits}-bit {wtype} weights in {fmt!r}", config
        )
    allowed = ("group", "channel") if fmt == "pack-quantized" else ("channel", "tensor")
    if strategy not in allowed:
        raise config_error(
            "compressed-tensors",
            f"group {name!r}: weight strategy {strategy!r} for {fmt!r}",
            config,
        )
    symmetric = bool(w.get("symmetric", True))
    if not symmetric and fmt != "pack-quantized":
        raise config_error(
            "compressed-tensors", f"group {name!r}: asymmetric {fmt!r} weights", config
        )
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "static", "weight", "group"):
        raise config_error("compressed-tensors", f"group {name!r}: actorder {actorder!r}", config)
    acts = group.get("input_activations")
    activations = None
    if acts:
        if fmt == "pack-quantized":
            raise config_error(
                "compressed-tensors", f"group {name!r}: activation quantization with int4", config
            )
        if (acts.get("type", "int"), acts.get("num_bits")) != (wtype, 8) or not acts.get(
            "symmetric", True
        ):
            raise config_error(
                "compressed-tensors", f"group {name!r}: input activations {acts}", config
            )
        if acts.get("dynamic") and acts.get("strategy") == "token":
            activations = "token"
        elif not acts.get("dynamic") and acts.get("strategy") == "tensor":
            activations = "tensor"
        else:
            raise config_error(
                "compressed-tensors",
                f"group {name!r}: {'dynamic' if acts.get('dynamic') else 'static'} "
                f"{acts.get('strategy')!r} activation scales (dynamic token or static tensor only)",
                config,
            )
    group_size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise config_error(
            "compressed-tensors", f"group {name!r}: group_size {group_size!r}", config
        )
    targets = tuple(group.get("targets") or ())
    return _Group(
        targets,
        fmt,
        int(bits),
        symmetric,
        strategy,
        group_size,
        actorder in (True, "group") and fmt == "pack-quantized",
        activations,
    )


class CompressedTensorsScheme(QuantScheme):
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise config_error(
                "compressed-tensors", f"quantization_status {status!r} (compressed only)", config
            )
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise config_error("compressed-tensors", key, config)
        groups = config.get("config_groups") or {}
        if not groups:
            raise config_error("compressed-tensors", "a config without config_groups", config)
        top = config.get("format")
        self.groups = [_parse_group(n, g, top, config) for n, g in groups.items()]
        self.ignore = list(config.get("ignore") or [])

    def is_ignored(self, name: str) -> bool:
        return matches_any(name, self.ignore)

    def _group(self, name: str) -> _Group | None:
        return next((g for g in self.groups if g.targets_linear(name)), None)

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        found = {self._group(n) for n in checkpoint_names}
        if len(found) > 1:
            raise ValueError(
                f"compressed-tensors: {', '.join(checkpoint_names)} (fused into {prefix}) "
                f"belong to different config groups"
            )
        group = found.pop()
        if group is None:
            return UnquantizedLinearMethod()  # targeted by no group
        cls = {
            "pack-quantized": PackedMethod,
            "int-quantized": Int8Method,
            "float-quantized": FP8Method,
        }[group.format]
        return cls(self, group)


class _CTMethod(QuantLinearMethod):
    def __init__(self, scheme: CompressedTensorsScheme, group: _Group) -> None:
        super().__init__(scheme)
        self.group = group


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned codes, 32/bits per word along `dim`, low bits first."""
    if bits == 4:
        return unpack_int4(words, dim)
    w = words.movedim(dim, -1).to(torch.int32)
    codes = (w[..., None] >> torch.arange(0, 32, 8, dtype=torch.int32)) & 0xFF
    return codes.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


class PackedMethod(_CTMethod):
    """pack-quantized: int4 (the int4 kernels) or int8 (W8A16; dequantized on CPU)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        gs = self.group.group_size or input_size
        per_word = 32 // self.group.num_bits
        if input_size % per_word or (not self.group.symmetric and output_size % per_word):
            raise ValueError(
                f"compressed-tensors {self.group.num_bits}-bit: {layer.prefix} ({input_size} "
                f"inputs, {output_size} outputs) does not pack into {per_word} codes per word"
            )
        self.group_size, self.groups = gs, -(-input_size // gs)
        empty_param(layer, "weight_packed", (output_size, input_size // per_word), torch.int32)
        empty_param(layer, "weight_scale", (output_size, self.groups), torch.float32)
        layouts = {
            "weight_packed": ParamLayout(output_dim=0),
            "weight_scale": ParamLayout(output_dim=0),
            "weight_shape": ParamLayout(output_dim=None, stash=True),
        }
        if not self.group.symmetric:
            empty_param(
                layer, "weight_zero_point", (output_size // per_word, self.groups), torch.int32
            )
            layouts["weight_zero_point"] = ParamLayout(output_dim=0, pack_factor=per_word)
        if self.group.has_g_idx:
            layouts["weight_g_idx"] = ParamLayout(output_dim=None, stash=True)
        return layouts

    def _codes(self, layer: nn.Module) -> Int4Codes:
        ranges = shard_ranges(layer)
        for shard, shape in stashed(layer, "weight_shape"):
            start, end = ranges[shard]
            if [int(v) for v in shape.flatten()] != [end - start, layer.input_size]:
                raise ValueError(
                    f"weight_shape{'[' + shard + ']' if shard else ''} says "
                    f"{shape.tolist()}, expected {[end - start, layer.input_size]}"
                )
        bits = self.group.num_bits
        q = _unpack(layer.weight_packed.data, bits, 1)
        z = None if self.group.symmetric else _unpack(layer.weight_zero_point.data, bits, 0)
        if bits == 8 and z is None:
            z = torch.full(layer.weight_scale.shape, 128, dtype=torch.int32)
        return Int4Codes(q, z, layer.weight_scale.data, self.group_size)

    def _g_idx(self, layer: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
        return shard_g_idx(layer, "weight_g_idx", self.groups)

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        same, g_idx = common_g_idx(self._g_idx(layer))
        if not same or self.group.num_bits != 4:
            return None
        codes = self._codes(layer)
        codes.g_idx = g_idx
        return codes

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_g_idx(layer, self._codes(layer), self._g_idx(layer))


# -- int8 and fp8: one weight per element, scales per channel or per tensor -------------


class _Float8Or8BitMethod(_CTMethod):
    weight_dtype: torch.dtype

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        empty_param(layer, "weight", (output_size, input_size), self.weight_dtype)
        layouts = {"weight": ParamLayout(output_dim=0)}
        if self.group.strategy == "channel":
            empty_param(layer, "weight_scale", (output_size, 1), torch.float32)
            layouts["weight_scale"] = ParamLayout(output_dim=0)
        else:
            layouts["weight_scale"] = ParamLayout(output_dim=None, stash=True)
        if self.group.activations == "tensor":
            layouts["input_scale"] = ParamLayout(output_dim=None, stash=True)
        return layouts

    def weight_scale(self, layer: nn.Module) -> torch.Tensor:
        """[N] float32 per channel (a per-tensor scale repeated over its shard's rows)."""
        if self.group.strategy == "channel":
            return layer.weight_scale.data.reshape(-1).float()
        out = torch.empty(layer.output_size)
        ranges = shard_ranges(layer)
        for shard, s in stashed(layer, "weight_scale"):
            if s.numel() != 1:
                raise ValueError(f"per-tensor weight_scale has {s.numel()} values")
            start, end = ranges[shard]
            out[start:end] = s.float().reshape(())
        return out

    def segments(self, layer: nn.Module) -> list[tuple[int, int, torch.Tensor | None]]:
        """Output row ranges that share a static input scale (one range when dynamic/none)."""
        if self.group.activations != "tensor":
            return [(0, layer.output_size, None)]
        ranges = shard_ranges(layer)
        segs: list[tuple[int, int, torch.Tensor | None]] = []
        for shard, s in stashed(layer, "input_scale"):
            if s.numel() != 1:
                raise ValueError(f"input_scale has {s.numel()} values (static per-tensor expected)")
            start, end = ranges[shard]
            s = s.float().reshape(1)
            if segs and segs[-1][2] is not None and torch.equal(segs[-1][2], s):
                segs[-1] = (segs[-1][0], end, s)
            else:
                segs.append((start, end, s))
        return segs

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.data.float() * self.weight_scale(layer)[:, None]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.kernel = self.build(layer)
        free_params(layer, [n for n in layer.layouts if n != "bias"])

    def build(self, layer: nn.Module):
        raise NotImplementedError


class Int8Method(_Float8Or8BitMethod):
    weight_dtype = torch.int8

    def build(self, layer: nn.Module):
        ws = self.weight_scale(layer)
        if self.group.activations is None:
            return Int8WeightOnlyKernel(layer.weight.data, ws, layer.device, layer.dtype)
        return Int8W8A8Kernel(layer.weight.data, ws, self.segments(layer), layer.device)


class FP8Method(_Float8Or8BitMethod):
    weight_dtype = torch.float8_e4m3fn

    def build(self, layer: nn.Module):
        return FP8Kernel(
            layer.weight.data,
            self.weight_scale(layer),
            self.segments(layer),
            self.group.activations,
            layer.device,
            layer.dtype,
        )
