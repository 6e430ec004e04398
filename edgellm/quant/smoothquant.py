"""SmoothQuant (Xiao et al., 2022): migrate activation outliers into the weights.

For the linears that read a norm's output, per input channel j:
s_j = max|X_j|^a / max|W_j|^(1-a) (max over calibration tokens, resp. over the
rows of all those linears), then X' = X / s (folded into the norm's weight)
and W' = W * s. The float model is unchanged; per-token int8 activations
lose far less to the few huge channels. Mappings as llm-compressor's recipe:
q/k/v <- input_layernorm, gate/up <- post_attention_layernorm; a = 0.8.
"""

from __future__ import annotations

import torch
from torch import nn

from edgellm.quant.decoder_parts import LayerParts
from edgellm.quant.layerwise import LayerwiseRunner, input_hooks


class ChannelAbsMax:
    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, x: torch.Tensor) -> None:
        m = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        prev = self.values.get(name)
        self.values[name] = m if prev is None else torch.maximum(prev, m)


def smooth_scales(act_max: torch.Tensor, linears: list[nn.Linear], alpha: float) -> torch.Tensor:
    w_max = torch.cat([lin.weight.data.float() for lin in linears], 0).abs().amax(0)
    s = act_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@torch.no_grad()
def smooth_layer(
    runner: LayerwiseRunner, index: int, parts: LayerParts, alpha: float = 0.8
) -> None:
    stats = ChannelAbsMax()
    taps = {"attn": next(iter(parts.qkv.values())), "mlp": next(iter(parts.gate_up.values()))}
    with input_hooks(taps, stats):
        runner.forward(index)
    for key, norm, group in (
        ("attn", parts.attn_norm, parts.qkv),
        ("mlp", parts.mlp_norm, parts.gate_up),
    ):
        if norm is None:  # the linears read the residual stream itself (EXAONE 4): not smoothed
            continue
        linears = list(group.values())
        s = smooth_scales(stats.values[key], linears, alpha)
        parts.divide_norm(norm, s)
        for lin in linears:
            lin.weight.data *= s
