"""AWQ (Lin et al., 2023): activation-aware weight quantization.

Per group of linears that read the same input, search a per-input-channel
scale s = mean|x|^alpha (optionally / mean|w|^(1-alpha), AutoAWQ's
"duo scaling") over a grid of alpha, scoring each candidate by the error of
the block's output (the attention block for q/k/v, the MLP for gate/up, the
linear itself for o_proj and down_proj) when the weights are quantized as
Q(W * s) / s. The winning s is folded into the previous op so the float
model is unchanged: 1/s into the RMSNorm weight (q/k/v, gate/up), into v's
rows (v -> o, only when v's outputs are o's inputs one to one, i.e. no GQA),
into up's rows (up -> down). Then a clipping search shrinks each group's
range where that lowers the output error, and the weights are rounded.
alpha = 0 (s = 1) is in the grid, so the search never does worse than plain
rounding on the calibration data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from edgellm.quant.decoder_parts import LayerParts
from edgellm.quant.gptq_solver import single_thread
from edgellm.quant.layerwise import LayerwiseRunner, input_hooks
from edgellm.quant.qparams import IntSpec, IntWeight, fake_quantize_groups, rtn_quantize

logger = logging.getLogger(__name__)

Inspect = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _mse(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for x, y in zip(a, b):
        total += float((x.float() - y.float()).pow(2).sum())
        count += x.numel()
    return total / max(count, 1)


def _channel_mean_abs(xs: list[torch.Tensor]) -> torch.Tensor:
    k = xs[0].shape[-1]
    total, rows = torch.zeros(k, dtype=torch.float64), 0
    for x in xs:
        x2 = x.reshape(-1, k)
        total += x2.abs().sum(0, dtype=torch.float64)
        rows += x2.shape[0]
    return (total / rows).float()


def _weight_mean(weights: list[torch.Tensor], spec: IntSpec) -> torch.Tensor:
    w = torch.cat(weights, 0).float()
    g = spec.group_len(w.shape[1])
    wg = w.abs().reshape(-1, g)
    wg = wg / (wg.amax(dim=1, keepdim=True) + 1e-6)
    return wg.reshape(w.shape).mean(0)


@torch.no_grad()
def search_scale(
    inputs: list[torch.Tensor],
    search_inputs: list[torch.Tensor],
    linears: list[nn.Linear],
    inspect: Inspect,
    spec: IntSpec,
    n_grid: int = 20,
    duo_scaling: bool = False,
) -> tuple[torch.Tensor, float]:
    """Best per-input-channel scale for `linears` (all reading `inputs`) -> (s, alpha)."""
    x_mean = _channel_mean_abs(inputs)
    originals = [lin.weight.data.clone() for lin in linears]
    w_mean = _weight_mean(originals, spec) if duo_scaling else None
    reference = inspect(search_inputs)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    try:
        for step in range(n_grid):
            alpha = step / n_grid
            if w_mean is not None:
                s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
            else:
                s = x_mean.pow(alpha)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, w0 in zip(linears, originals):
                lin.weight.data = fake_quantize_groups(w0 * s, spec) / s
            loss = _mse(reference, inspect(search_inputs))
            if loss < best[0]:
                best = (loss, s.clone(), alpha)
    finally:
        for lin, w0 in zip(linears, originals):
            lin.weight.data = w0
    return best[1], best[2]


@torch.no_grad()
def search_clip(
    weight: torch.Tensor,
    inputs: list[torch.Tensor],
    spec: IntSpec,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    oc_batch: int = 64,
) -> torch.Tensor:
    """Per-(row, group) clip value minimizing each group's output error -> max |w| [N, G, 1]."""
    n, k = weight.shape
    g = spec.group_len(k)
    x = torch.cat([t.reshape(-1, k) for t in inputs], 0).float()
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    xg = x.reshape(-1, k // g, g).transpose(0, 1)  # [G, T, g]
    best_all = []
    for r0 in range(0, n, oc_batch):
        w = weight[r0 : r0 + oc_batch].float()
        rows = w.shape[0]
        wg = w.reshape(rows, k // g, g).transpose(0, 1)  # [G, n, g]
        org_max = wg.abs().amax(dim=-1, keepdim=True)  # [G, n, 1]
        best_max = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        org_out = torch.bmm(xg, wg.transpose(1, 2))  # [G, T, n]: each group's share of the output
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i_s / n_grid)
            cur = torch.clamp(wg, -max_val, max_val)
            q = fake_quantize_groups(cur.reshape(-1, g), dataclasses.replace(spec, group_size=g))
            out = torch.bmm(xg, q.reshape(cur.shape).transpose(1, 2))
            err = (out - org_out).pow(2).mean(dim=1)[..., None]  # [G, n, 1]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better, max_val, best_max)
        best_all.append(best_max.transpose(0, 1))  # [n, G, 1]
    return torch.cat(best_all, 0)


def _scale_rows(lin: nn.Linear, rows: slice, s: torch.Tensor) -> None:
    """Divide output rows `rows` of `lin` (and its bias) by s."""
    lin.weight.data[rows] /= s[:, None]
    if lin.bias is not None:
        lin.bias.data[rows] /= s


@torch.no_grad()
def awq_layer(
    runner: LayerwiseRunner,
    index: int,
    parts: LayerParts,
    spec: IntSpec,
    scale_dtype: torch.dtype,
    n_grid: int = 20,
    duo_scaling: bool = False,
    clip: bool = True,
    search_tokens: int = 4096,
    skip: set[str] | None = None,
) -> dict[str, IntWeight]:
    """Scale-search, clip and quantize one decoder layer in place; returns its quantized linears."""
    skip = skip or set()
    first_qkv = next(iter(parts.qkv.values()))
    first_gu = next(iter(parts.gate_up.values()))
    o, down = parts.o[1], parts.down[1]
    feats: dict[str, list[torch.Tensor]] = {"attn": [], "o": [], "mlp": [], "down": []}
    taps = {"attn": first_qkv, "o": o, "mlp": first_gu, "down": down}
    with input_hooks(taps, lambda name, x: feats[name].append(x.float())):
        runner.forward(index)
    # the scale search runs the block on whole sequences, up to a token budget
    n_search = 1
    while (
        n_search < len(feats["attn"])
        and sum(t.shape[0] * t.shape[1] for t in feats["attn"][:n_search]) < search_tokens
    ):
        n_search += 1

    def sub(name: str) -> list[torch.Tensor]:
        return feats[name][:n_search]

    def divide(name: str, s: torch.Tensor) -> None:
        feats[name] = [t / s for t in feats[name]]

    alphas = {}

    def after_norm(
        key: str, feat: str, norm: nn.Module | None, lins: list[nn.Linear], block: Callable
    ) -> None:
        """Scale the linears that read a norm's output; the norm's weight takes the inverse.
        Linears that read the residual stream itself (no norm: EXAONE 4) keep their scale."""
        if norm is None:
            return
        s, alphas[key] = search_scale(
            feats[feat], sub(feat), lins, block, spec, n_grid, duo_scaling
        )
        parts.divide_norm(norm, s)
        for lin in lins:
            lin.weight.data *= s
        divide(feat, s)

    # q/k/v <- input norm, scored on the attention block
    after_norm(
        "qkv",
        "attn",
        parts.attn_norm,
        list(parts.qkv.values()),
        lambda xs: runner.run_module(parts.attn, xs, index),
    )

    # v -> o where v's outputs feed o one to one
    if parts.fused_qkv:
        fused = parts.qkv["qkv_proj"]
        v_size = o.in_features
        v_rows = slice(fused.out_features - v_size, fused.out_features)
        v_ok = fused.out_features == 3 * v_size
        v_lin = fused
    else:
        v_lin = parts.qkv["v_proj"]
        v_rows = slice(0, v_lin.out_features)
        v_ok = (
            v_lin.out_features == o.in_features
            and parts.qkv["q_proj"].out_features == v_lin.out_features
        )
    if v_ok:
        s, alphas["o"] = search_scale(
            feats["o"], sub("o"), [o], lambda xs: [o(x) for x in xs], spec, n_grid, duo_scaling
        )
        _scale_rows(v_lin, v_rows, s)
        o.weight.data *= s
        divide("o", s)

    # gate/up <- post-attention norm, scored on the MLP
    after_norm(
        "gate_up",
        "mlp",
        parts.mlp_norm,
        list(parts.gate_up.values()),
        lambda xs: runner.run_module(parts.mlp, xs),
    )

    # up -> down
    if parts.fused_gate_up:
        up_lin = parts.gate_up["gate_up_proj"]
        up_rows = slice(up_lin.out_features // 2, up_lin.out_features)
    else:
        up_lin = parts.gate_up["up_proj"]
        up_rows = slice(0, up_lin.out_features)
    s, alphas["down"] = search_scale(
        feats["down"],
        sub("down"),
        [down],
        lambda xs: [down(x) for x in xs],
        spec,
        n_grid,
        duo_scaling,
    )
    _scale_rows(up_lin, up_rows, s)
    down.weight.data *= s
    divide("down", s)
    logger.debug("%s: AWQ alphas %s", parts.prefix, alphas)

    inputs_of = {}
    for name in parts.qkv:
        inputs_of[f"{parts.prefix}.self_attn.{name}"] = "attn"
    inputs_of[f"{parts.prefix}.self_attn.o_proj"] = "o"
    for name in parts.gate_up:
        inputs_of[f"{parts.prefix}.mlp.{name}"] = "mlp"
    inputs_of[f"{parts.prefix}.mlp.down_proj"] = "down"

    out: dict[str, IntWeight] = {}
    for full, lin in parts.linears.items():
        if full in skip:
            continue
        leaf = full.rsplit(".", 1)[-1]
        w = lin.weight.data
        if clip and leaf not in ("q_proj", "k_proj", "qkv_proj"):  # q/k: softmax amplifies clipping
            with single_thread():
                max_val = search_clip(w, feats[inputs_of[full]], spec, n_grid)
            k = w.shape[1]
            g = spec.group_len(k)
            wg = w.reshape(w.shape[0], k // g, g)
            w = torch.clamp(wg, -max_val, max_val).reshape(w.shape)
        q = rtn_quantize(w, spec, scale_dtype)
        lin.weight.data = q.dequantize().to(lin.weight.dtype)
        out[full] = q
    return out
