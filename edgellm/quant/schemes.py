"""The one place quantization plugs in.

A QuantScheme is chosen from a checkpoint's `quantization_config` (or a
GGUF's tensor types). For every linear layer it hands out a LinearMethod
(edgellm/quant/linear_method.py), which owns that layer's parameters: what
they are called on disk, their shapes, along which dim a fused module's shards
are concatenated, and how the matmul runs. Layers and the loader never branch
on the format.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from edgellm.quant.linear_method import LinearMethod, UnquantizedLinearMethod

if TYPE_CHECKING:
    from edgellm.platform import Platform

# CPU kernels for quantized linears: "auto", "exact" or "fast" (edgellm/platform.py says what
# each runs). Chosen per load through the Platform the loader hands the scheme; a bare mode
# string (tests, tools) builds a Platform for this host.
CPU_KERNELS = ("auto", "exact", "fast")


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
        from edgellm.quant.gguf_scheme import GGUFScheme

        return GGUFScheme(quantization_config, cpu_kernels)
    method = method or str(quantization_config.get("format") or "?")
    raise ValueError(
        f"quantization format {method!r} is not supported by this build (supported: awq, gptq, "
        f"compressed-tensors, bitsandbytes, gguf; quantization_config={quantization_config})"
    )
