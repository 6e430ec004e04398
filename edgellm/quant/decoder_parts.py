"""A transformers decoder's layers, and each layer's modules by role.

LayerParts names a Llama-style decoder layer's attention and MLP, the norms their linears
read (where there are such norms), and every linear (fused qkv_proj / gate_up_proj or
not), by full module name. What the algorithms of `edgellm convert` act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from edgellm.quant.calibration import CalibrationError


@dataclass
class LayerParts:
    """One decoder layer's modules by role (fused = Phi-3 style qkv_proj / gate_up_proj).

    attn_norm / mlp_norm: the norm whose output the q/k/v (gate/up) linears read, where there is
    one: Llama-style layers have both, Gemma 3 has them too (its MLP reads
    pre_feedforward_layernorm), EXAONE 4's post-norm layers have neither (the linears read the
    residual stream itself, so no input scale can be folded anywhere). norm_offset: the norms
    scale by (offset + weight) (1 for Gemma's)."""

    layer: nn.Module
    prefix: str  # e.g. "model.layers.3"
    attn: nn.Module
    mlp: nn.Module
    attn_norm: nn.Module | None
    mlp_norm: nn.Module | None
    qkv: dict[str, nn.Linear]  # {"q_proj":..., "k_proj":..., "v_proj":...} or {"qkv_proj": ...}
    o: tuple[str, nn.Linear]
    gate_up: dict[str, nn.Linear]  # {"gate_proj":..., "up_proj":...} or {"gate_up_proj": ...}
    down: tuple[str, nn.Linear]
    linears: dict[str, nn.Linear] = field(default_factory=dict)  # full name -> module
    norm_offset: float = 0.0

    def divide_norm(self, norm: nn.Module, s: torch.Tensor) -> None:
        """Divide `norm`'s output per channel by s (the linears reading it take s on their
        inputs): (offset + weight) / s as the new (offset + weight)."""
        w = norm.weight.data
        w.copy_((w.float() + self.norm_offset) / s - self.norm_offset)

    @property
    def fused_qkv(self) -> bool:
        return "qkv_proj" in self.qkv

    @property
    def fused_gate_up(self) -> bool:
        return "gate_up_proj" in self.gate_up


def norm_offset_of(model: nn.Module) -> float:
    """What the model's RMSNorms add to their weight (Gemma's (1 + weight)), from its
    architecture."""
    from edgellm.models.arch import resolve_architecture

    try:
        return resolve_architecture(model.config.to_dict()).norm_weight_offset
    except (AttributeError, ValueError):
        return 0.0


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CalibrationError(f"{type(model).__name__}: no model.layers; unsupported architecture")
    return "model.layers", layers


def layer_parts(layer: nn.Module, prefix: str, norm_offset: float = 0.0) -> LayerParts:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        raise CalibrationError(f"{prefix}: not a Llama-style decoder layer")
    attn_norm = getattr(layer, "input_layernorm", None)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: norms around both branches
        mlp_norm = layer.pre_feedforward_layernorm
    elif hasattr(layer, "post_feedforward_layernorm"):  # EXAONE 4: norms on branch outputs only
        mlp_norm = None
    else:
        mlp_norm = getattr(layer, "post_attention_layernorm", None)
        if attn_norm is None or mlp_norm is None:
            raise CalibrationError(f"{prefix}: not a Llama-style decoder layer")
    if hasattr(attn, "qkv_proj"):
        qkv = {"qkv_proj": attn.qkv_proj}
    else:
        qkv = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}
    gate_up = (
        {"gate_up_proj": mlp.gate_up_proj}
        if hasattr(mlp, "gate_up_proj")
        else {n: getattr(mlp, n) for n in ("gate_proj", "up_proj")}
    )
    parts = LayerParts(
        layer,
        prefix,
        attn,
        mlp,
        attn_norm,
        mlp_norm,
        qkv,
        ("o_proj", attn.o_proj),
        gate_up,
        ("down_proj", mlp.down_proj),
        norm_offset=norm_offset,
    )
    for name, mod in qkv.items():
        parts.linears[f"{prefix}.self_attn.{name}"] = mod
    parts.linears[f"{prefix}.self_attn.o_proj"] = attn.o_proj
    for name, mod in gate_up.items():
        parts.linears[f"{prefix}.mlp.{name}"] = mod
    parts.linears[f"{prefix}.mlp.down_proj"] = mlp.down_proj
    for name, mod in parts.linears.items():
        if not isinstance(mod, nn.Linear):
            raise CalibrationError(f"{name}: expected a Linear, got {type(mod).__name__}")
    return parts
