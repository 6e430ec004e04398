"""compressed-tensors `config_groups`: each group parsed into a CTGroup (which linears it
targets, the on-disk format, bits, symmetry, weight strategy, group size, act-order and
activation quantization), with every unsupported combination rejected by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgellm.quant.schemes import config_error, matches_any


@dataclass(frozen=True)
class CTGroup:
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


def parse_group(
    name: str, group: dict[str, Any], top_format: str | None, config: dict[str, Any]
) -> CTGroup:
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
    return CTGroup(
        targets,
        fmt,
        int(bits),
        symmetric,
        strategy,
        group_size,
        actorder in (True, "group") and fmt == "pack-quantized",
        activations,
    )
