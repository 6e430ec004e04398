"""The linear methods of compressed-tensors checkpoints, one per format.

PackedMethod: pack-quantized int4 (the int4 kernels) or int8 (W8A16), with group or
channel scales, optional zero points and act-order g_idx. Int8Method and FP8Method:
int-quantized and float-quantized, one weight per element with per-channel or per-tensor
scales (per-tensor scales of fused shards expanded per channel; static input scales kept
per shard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from edgellm.kernels.int4_layouts import unpack_int4
from edgellm.quant.compressed_tensors_config import CTGroup
from edgellm.quant.int_codes import Int4Codes
from edgellm.quant.linear_kernels.w8a8 import FP8Kernel, Int8W8A8Kernel, Int8WeightOnlyKernel
from edgellm.quant.linear_method import ParamLayout, QuantLinearMethod
from edgellm.quant.shard_params import (
    common_g_idx,
    dequantize_g_idx,
    empty_param,
    free_params,
    shard_g_idx,
    shard_ranges,
    stashed,
)

if TYPE_CHECKING:
    from edgellm.quant.compressed_tensors import CompressedTensorsScheme


class CTMethod(QuantLinearMethod):
    def __init__(self, scheme: CompressedTensorsScheme, group: CTGroup) -> None:
        super().__init__(scheme)
        self.group = group


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned codes, 32/bits per word along `dim`, low bits first."""
    if bits == 4:
        return unpack_int4(words, dim)
    w = words.movedim(dim, -1).to(torch.int32)
    codes = (w[..., None] >> torch.arange(0, 32, 8, dtype=torch.int32)) & 0xFF
    return codes.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


class PackedMethod(CTMethod):
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


class _Float8Or8BitMethod(CTMethod):
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
