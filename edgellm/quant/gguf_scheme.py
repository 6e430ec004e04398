"""GGUFScheme: the linears of a GGUF checkpoint, kept as raw GGUF blocks, onto the kernels.

The blocks decode to integer codes with group scales (quant/gguf_blocks.py): Q4_0, Q4_1
and Q4_K are int4 and run on the int4 kernels (Q4_0 on the CUDA W4A16 kernel too);
Q5_0/Q5_1/Q5_K/Q6_K/Q3_K/Q2_K/Q8_0/IQ4_NL/IQ4_XS, and modules whose shards mix types, are
int8 codes for the CPU integer-dot kernel. Where a kernel cannot take them (another CPU
mode, CUDA for all but Q4_0, types without an integer decoding), the weight is dequantized
once at load with gguf-py's reference dequantizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from edgellm.quant import gguf_blocks
from edgellm.quant.gguf import GGUFError
from edgellm.quant.int_codes import Int4Codes, Int8Codes, SplitScales
from edgellm.quant.linear_method import (
    LinearMethod,
    ParamLayout,
    QuantLinearMethod,
    UnquantizedLinearMethod,
)
from edgellm.quant.schemes import QuantScheme
from edgellm.quant.shard_params import shard_ranges, stashed


class GGUFScheme(QuantScheme):
    name = "gguf"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        self.linear_types: dict[str, str] = dict(config.get("linear_types") or {})
        from gguf import GGMLQuantizationType

        for name, type_name in self.linear_types.items():
            if type_name not in GGMLQuantizationType.__members__:
                raise GGUFError(f"GGUF tensor {name}: unknown type {type_name!r}")

    def _type(self, module: str) -> str | None:
        return self.linear_types.get(f"{module}.weight")

    def linear_method(self, prefix: str, checkpoint_names: Sequence[str] = ()) -> LinearMethod:
        names = list(checkpoint_names) or [prefix]
        types = [self._type(n) for n in names]
        if all(t is None for t in types):
            return UnquantizedLinearMethod()
        if any(t is None for t in types):
            raise GGUFError(
                f"GGUF: the shards of {prefix} mix float and quantized tensors: "
                f"{dict(zip(names, types))}"
            )
        return GGUFLinearMethod(self, types)  # type: ignore[arg-type]

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        raise AssertionError("GGUFScheme picks methods in linear_method")


class GGUFLinearMethod(QuantLinearMethod):
    """Raw GGUF blocks per shard (shards may differ in type, as in Q4_K_M's q/k/v)."""

    scheme: GGUFScheme

    def __init__(self, scheme: GGUFScheme, types: list[str]) -> None:
        super().__init__(scheme)
        self.types = types  # per shard, in shard order (one: the whole module)

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        return {"weight": ParamLayout(output_dim=None, stash=True)}

    def _parts(self, layer: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
        """[(shard, type, raw rows)] in output order, shapes checked."""
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES

        ranges = shard_ranges(layer)
        out = []
        for shard, raw in stashed(layer, "weight"):
            if len(self.types) == 1:
                type_name = self.types[0]
            elif shard:
                type_name = self.types[layer.shards.index(shard)]
            else:
                raise ValueError(
                    f"GGUF: one tensor for the whole of {layer.prefix}, typed per shard"
                )
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
            start, end = ranges[shard]
            expected = (end - start, layer.input_size // block * block_bytes)
            if layer.input_size % block or tuple(raw.shape) != expected:
                raise ValueError(
                    f"GGUF {type_name} weight{' [' + shard + ']' if shard else ''} has "
                    f"shape {tuple(raw.shape)}, expected {expected}"
                )
            out.append((shard, type_name, raw))
        return out

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        """All shards int4 types (Q4_0, Q4_1, Q4_K): one Int4Codes, groups of 32; Q4_0 alone stays
        symmetric (the CUDA kernel's form), mixed with the others it takes offsets m = -8 d."""
        parts = self._parts(layer)
        kinds = {t for _, t, _ in parts}
        if not kinds <= set(gguf_blocks.INT4_TYPES):
            return None
        decoded = [gguf_blocks.int4_codes(raw, t) for _, t, raw in parts]
        codes = torch.cat([c.codes for c in decoded], 0)
        scales = torch.cat([c.scales.float() for c in decoded], 0)
        if kinds == {"Q4_0"}:
            return Int4Codes(codes, None, scales, 32)
        offsets = torch.cat(
            [c.offsets if c.offsets is not None else -8.0 * c.scales.float() for c in decoded], 0
        )
        return Int4Codes(
            codes,
            None,
            scales,
            32,
            offsets=offsets,
            scale_split=SplitScales.cat([c.scale_split for c in decoded]),
            offset_split=SplitScales.cat([c.offset_split for c in decoded]),
        )

    def int8(self, layer: nn.Module) -> Int8Codes | None:
        """Shards of any integer-decodable type (gguf_blocks.SUPPORTED) as one Int8Codes, in the
        finest group among them (16 when any is Q6_K/Q3_K/Q2_K); None when some type has no
        integer decoding (it is dequantized)."""
        parts = self._parts(layer)
        types = [t for _, t, _ in parts]
        if not set(types) <= set(gguf_blocks.SUPPORTED):
            return None
        group = min(gguf_blocks.group_of(t) for t in types)
        return gguf_blocks.concat_int8(
            [gguf_blocks.int8_codes(raw, t, group) for _, t, raw in parts]
        )

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = []
        for _shard, type_name, raw in self._parts(layer):
            arr = dequantize(raw.numpy(), GGMLQuantizationType[type_name])
            rows.append(
                torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
                    raw.shape[0], layer.input_size
                )
            )
        return torch.cat(rows, 0) if len(rows) > 1 else rows[0]
