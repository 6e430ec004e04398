"""The one place quantization plugs in.

A QuantScheme is chosen from a checkpoint's `quantization_config` (or a
GGUF's tensor types). For every linear layer it hands out a LinearMethod,
which owns that layer's parameters: what they are called on disk, their
shapes, along which dim a fused module's shards are concatenated, and how
the matmul runs. Layers and the loader never branch on the format.

Weight-only formats subclass QuantLinearMethod: the format only decodes its
tensors (exactly: `dequantize`, and where it is plain int4, `int4`); the base
picks the matmul (edgellm/quant/backends.py): the Triton kernels on CUDA, and on CPU
what the load's Platform says (edgellm/platform.py: integer dots in mode auto,
dequantized once in mode exact).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from edgellm.platform import Platform

# CPU kernels for quantized linears: "auto", "exact" or "fast" (edgellm/platform.py says what
# each runs). Chosen per load through the Platform the loader hands the scheme; a bare mode
# string (tests, tools) builds a Platform for this host.
CPU_KERNELS = ("auto", "exact", "fast")


@dataclass(frozen=True)
class ParamLayout:
    """How a checkpoint tensor of a linear relates to the layer's output features.

    output_dim: the tensor dim indexing output features (None: not sharded).
    pack_factor: output features per element along output_dim (8 for int4
    packed along the output dim, else 1).
    stash: not preallocated; each shard's tensor is kept as loaded in
    `layer.stash[name][shard]` (shard "" = the whole fused tensor) for
    process_weights_after_loading to assemble: per-tensor scales of fused
    shards, tensors whose shape only the file knows, or blobs.
    optional: a checkpoint may omit it.
    """

    output_dim: int | None = 0
    pack_factor: int = 1
    stash: bool = False
    optional: bool = False


class LinearMethod(ABC):
    """Owns one linear layer's parameters and its matmul."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        """Register the parameters on `layer` (empty) and return their layouts, keyed by
        the checkpoint's parameter names (stashed ones may contain dots and need no attribute)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W.T + bias, for x [..., input_size]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack or convert once all shards are in (e.g. into a kernel's preferred layout)."""


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype), requires_grad=False
        )
        return {"weight": ParamLayout(output_dim=0)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


# -- helpers for formats --------------------------------------------------------------


def empty_param(layer: nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Register an empty, frozen parameter (float checkpoint values are kept in float32: exact)."""
    setattr(layer, name, nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False))


def stashed(layer: nn.Module, name: str) -> list[tuple[str, torch.Tensor]]:
    """[(shard, tensor)] of a stashed parameter in shard order ("" = stored whole)."""
    parts = layer.stash.get(name, {})
    if "" in parts:
        if len(parts) > 1:
            raise ValueError(f"{layer.prefix}.{name}: stored both whole and as shards")
        return [("", parts[""])]
    return [(s, parts[s]) for s in layer.shards if s in parts]


def shard_ranges(layer: nn.Module) -> dict[str, tuple[int, int]]:
    """Output rows of each shard (shard "" = all rows)."""
    out, start = {"": (0, layer.output_size)}, 0
    for name, size in layer.shard_sizes.items():
        out[name] = (start, start + size)
        start += size
    return out


def free_params(layer: nn.Module, names: Iterable[str]) -> None:
    """Drop the on-disk tensors once a kernel holds what it needs."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
    layer.stash.clear()


def shard_g_idx(
    layer: nn.Module, name: str, num_groups: int
) -> list[tuple[str, torch.Tensor | None]]:
    """A stashed per-shard g_idx (act-order: group of each input row) as [(shard, g_idx or
    None)] covering the whole output, checked against the layer's inputs and groups."""
    given = dict(stashed(layer, name))
    k = layer.input_size
    for shard, g in given.items():
        where = f"{layer.prefix}.{name}" + (f" (shard {shard})" if shard else "")
        if tuple(g.shape) != (k,):
            raise ValueError(f"{where} has shape {tuple(g.shape)}, expected ({k},)")
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= num_groups):
            raise ValueError(f"{where} indexes groups outside 0..{num_groups - 1}")
    if "" in given:
        return [("", given[""])]
    return [(s, given.get(s)) for s in (layer.shards or [""])]


def common_g_idx(
    per_shard: list[tuple[str, torch.Tensor | None]],
) -> tuple[bool, torch.Tensor | None]:
    """(whether every shard has the same g_idx, that g_idx)."""
    first = per_shard[0][1]
    for _, g in per_shard[1:]:
        if (g is None) != (first is None) or (g is not None and not torch.equal(g, first)):
            return False, None
    return True, first


def dequantize_by_shard(
    layer: nn.Module, codes: Int4Codes, per_shard: list[tuple[str, torch.Tensor | None]]
) -> torch.Tensor:
    """Exact W when the shards of a fused module each have their own g_idx."""
    rows, start = [], 0
    for shard, g in per_shard:
        end = start + (layer.shard_sizes[shard] if shard else layer.output_size)
        part = Int4Codes(
            codes.codes[start:end],
            None if codes.zeros is None else codes.zeros[start:end],
            codes.scales[start:end],
            codes.group_size,
            g,
        )
        rows.append(part.dequantize())
        start = end
    return torch.cat(rows, 0)


def dequantize_g_idx(
    layer: nn.Module, codes: Int4Codes, per_shard: list[tuple[str, torch.Tensor | None]]
) -> torch.Tensor:
    """Exact W of an act-order (g_idx) int4 layer: one g_idx for the whole fused module when its
    shards share it, else each shard with its own."""
    same, g_idx = common_g_idx(per_shard)
    if not same:
        return dequantize_by_shard(layer, codes, per_shard)
    codes.g_idx = g_idx
    return codes.dequantize()


class QuantLinearMethod(LinearMethod):
    """A weight-quantized linear: the format decodes, edgellm/quant/backends.py chooses the matmul.

    Subclasses implement `create_weights` and `dequantize` (exact float32 W [N, K]),
    and `int4` where the weights are plain int4 codes with group scales.
    """

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32, exactly as the format defines it."""

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        """The weights as int4 codes with group scales, when the format is that (else None)."""
        return None

    def int8(self, layer: nn.Module) -> Int8Codes | None:
        """The weights as int8 codes with group scales, when the format is that (else None)."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from edgellm.quant.backends import build_kernel

        layer.kernel = build_kernel(self, layer, self.scheme.platform)
        free_params(layer, [n for n in layer.layouts if n != "bias"])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.kernel(x, bias)


@dataclass
class Int8Codes:
    """int8 weights with group scales: W[n, k] = scales[n, g] * codes[n, k] (+ offsets[n, g]),
    g = k // group_size (GGUF Q8_0: groups of 32 with an fp16 scale; the 5- and 6-bit and
    K-quant types: see quant/gguf_blocks.py, groups of 16 or 32, fp32 scales, some offsets)."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / group_size] float
    group_size: int
    offsets: torch.Tensor | None = None  # [N, K / group_size] float

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 with one rounding per element (two with offsets)."""
        n, k = self.codes.shape
        w = (
            self.codes.float().reshape(n, k // self.group_size, self.group_size)
            * self.scales.float()[..., None]
        )
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.reshape(n, k)


@dataclass
class Int4Codes:
    """Unpacked int4: W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g] + offsets[n, g],
    g = g_idx[k] or k // group_size. zeros None = 8 (symmetric) when there are no
    offsets, else 0: GGUF Q4_1 is W = codes * d + m, m the block minimum."""

    codes: torch.Tensor  # [N, K] int 0..15
    zeros: torch.Tensor | None  # [N, G] int
    scales: torch.Tensor  # [N, G] float
    group_size: int
    g_idx: torch.Tensor | None = None  # [K]
    offsets: torch.Tensor | None = None  # [N, G] float

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 with one rounding per element (exact for fp16/bf16 scales)."""
        k = self.codes.shape[1]
        g = (
            self.g_idx.long()
            if self.g_idx is not None
            else torch.arange(k, device=self.codes.device) // self.group_size
        )
        q = self.codes.float()
        if self.zeros is not None:
            q = q - self.zeros.float()[:, g]
        elif self.offsets is None:
            q = q - 8.0
        w = q * self.scales.float()[:, g]
        if self.offsets is not None:
            w = w + self.offsets.float()[:, g]
        return w


# -- schemes --------------------------------------------------------------------------


def matches_any(name: str, patterns: Iterable[str], substring: bool = False) -> bool:
    """compressed-tensors style: "re:<regex>" (re.match) or an exact module name; with
    substring=True a plain pattern matches anywhere in the name (AutoAWQ, transformers' bnb)."""
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or (substring and pat in name):
            return True
    return False


class QuantScheme(ABC):
    """A checkpoint format: hands out a LinearMethod per linear layer."""

    name: str = "none"

    def __init__(self, cpu_kernels: str | Platform | None = None) -> None:
        """cpu_kernels: the load's Platform, or a CPU mode for one made here (None: the
        EDGELLM_CPU_QUANT default, else auto)."""
        from edgellm.platform import Platform

        self.platform = cpu_kernels if isinstance(cpu_kernels, Platform) else Platform(cpu_kernels)
        self.cpu_kernels = self.platform.cpu_quant

    def linear_method(self, prefix: str, checkpoint_names: Sequence[str] = ()) -> LinearMethod:
        """The method for the linear at module path `prefix` (e.g.
        model.layers.0.self_attn.qkv_proj).

        checkpoint_names: what the checkpoint's own model calls it, which is what ignore lists
        name (…q_proj, …k_proj, …v_proj for a Llama's fused qkv_proj; default [prefix]). It is
        left unquantized if all of them are ignored; ignoring only some is an error.
        """
        names = list(checkpoint_names) or [prefix]
        ignored = [n for n in names if self.is_ignored(n)]
        if len(ignored) == len(names):
            return UnquantizedLinearMethod()
        if ignored:
            raise ValueError(
                f"{self.name}: {', '.join(ignored)} are left unquantized but the other shards of "
                f"the fused {prefix} are quantized; mixed fused modules are not supported"
            )
        return self.quantized_method(prefix, names)

    def is_ignored(self, name: str) -> bool:
        return False

    @abstractmethod
    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        """The method for a linear this format quantizes."""


class Unquantized(QuantScheme):
    name = "none"

    def is_ignored(self, name: str) -> bool:
        return True

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        return UnquantizedLinearMethod()


def config_error(fmt: str, what: str, quantization_config: dict[str, Any]) -> ValueError:
    return ValueError(
        f"{fmt} checkpoint: {what} is not supported (quantization_config={quantization_config})"
    )


def scheme_from_config(
    quantization_config: dict[str, Any] | None, cpu_kernels: str | Platform | None = None
) -> QuantScheme:
    """Pick the scheme for a checkpoint; a format we cannot run exactly is an error, never a
    guess."""
    if not quantization_config:
        return Unquantized(cpu_kernels)
    method = str(quantization_config.get("quant_method") or "").lower()
    if method == "awq":
        from edgellm.quant.awq import AWQScheme

        return AWQScheme(quantization_config, cpu_kernels)
    if method == "gptq":
        from edgellm.quant.gptq import GPTQScheme

        return GPTQScheme(quantization_config, cpu_kernels)
    if method == "compressed-tensors":
        from edgellm.quant.compressed_tensors import CompressedTensorsScheme

        return CompressedTensorsScheme(quantization_config, cpu_kernels)
    if method == "bitsandbytes":
        from edgellm.quant.bnb import BitsAndBytesScheme

        return BitsAndBytesScheme(quantization_config, cpu_kernels)
    if method == "gguf":
        from edgellm.quant.gguf import GGUFScheme

        return GGUFScheme(quantization_config, cpu_kernels)
    method = method or str(quantization_config.get("format") or "?")
    raise ValueError(
        f"quantization format {method!r} is not supported by this build (supported: awq, gptq, "
        f"compressed-tensors, bitsandbytes, gguf; quantization_config={quantization_config})"
    )
