"""The quantization pass of `edgellm convert`: every decoder linear, layer by layer.

Calibrated schemes replay the calibration set through one decoder layer at a
time (layerwise.LayerwiseRunner): collect what the algorithm needs from the
layer's inputs (Hessians for GPTQ, activation maxima for SmoothQuant and FP8
input scales, cached inputs for AWQ), quantize the layer in place (weights are
replaced by their dequantized values), then run the quantized layer to produce
the next layer's inputs. With an FP8 KV cache the same pass records max |K|,
max |V| per attention module (after rope, as the cache sees them).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from edgellm.quant.awq_search import awq_layer
from edgellm.quant.decoder_parts import LayerParts, decoder_layers, layer_parts
from edgellm.quant.export import Scheme
from edgellm.quant.gptq_solver import HessianAccumulator, gptq_quantize
from edgellm.quant.layerwise import LayerwiseRunner, input_hooks
from edgellm.quant.qparams import (
    FP8Weight,
    IntSpec,
    IntWeight,
    fp8_input_scale,
    fp8_quantize,
    rtn_quantize,
)
from edgellm.quant.smoothquant import smooth_layer


@contextmanager
def kv_observer(model: nn.Module):
    """Record max |K| and |V| (after rope, as the cache sees them) per attention module."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    maxima: dict[int, list[float]] = {}
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]

    def observing(module, query, key, value, *args, **kwargs):
        m = maxima.setdefault(id(module), [0.0, 0.0])
        m[0] = max(m[0], float(key.detach().abs().max()))
        m[1] = max(m[1], float(value.detach().abs().max()))
        return original(module, query, key, value, *args, **kwargs)

    mapping["sdpa"] = observing
    try:
        yield maxima
    finally:
        mapping["sdpa"] = original


def _spec(scheme: Scheme, fmt: str) -> IntSpec:
    return IntSpec(
        scheme.bits,
        scheme.symmetric,
        scheme.group_size,
        min_zero=1 if fmt == "gptq" and not scheme.symmetric else 0,
    )


def _input_group(parts: LayerParts, name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in parts.qkv:
        return f"{parts.prefix}.attn_in"
    if leaf in parts.gate_up:
        return f"{parts.prefix}.mlp_in"
    return name


def _set_weight(lin: nn.Linear, w: torch.Tensor) -> None:
    lin.weight.data = w.to(lin.weight.dtype).contiguous()


def _quantize_direct(
    lin: nn.Linear, scheme: Scheme, spec: IntSpec, dtype: torch.dtype
) -> IntWeight | FP8Weight:
    if scheme.kind == "fp8":
        q: IntWeight | FP8Weight = fp8_quantize(lin.weight.data, scheme.fp8_per_channel, dtype)
    else:
        q = rtn_quantize(lin.weight.data, spec, dtype)
    _set_weight(lin, q.dequantize())
    return q


def quantize_model(
    model: nn.Module,
    scheme: Scheme,
    opts: Any,
    samples: list[list[int]] | None,
    dtype: torch.dtype,
    skip: set[str],
) -> tuple[dict[str, IntWeight | FP8Weight], dict[str, tuple[float, float]]]:
    """Quantize every decoder linear in place (fake-quant weights); returns the quantized tensors
    and, with an FP8 KV cache, (max|K|, max|V|) per attention module prefix."""
    spec = _spec(scheme, opts.format)
    results: dict[str, IntWeight | FP8Weight] = {}
    kv: dict[str, tuple[float, float]] = {}
    prefix, layers = decoder_layers(model)
    want_kv = opts.kv_cache_dtype == "fp8"
    if samples is None:  # no calibration: weights only
        for i in tqdm(range(len(layers)), desc=f"quantize ({scheme.algorithm})"):
            parts = layer_parts(layers[i], f"{prefix}.{i}")
            for name, lin in parts.linears.items():
                if name not in skip:
                    results[name] = _quantize_direct(lin, scheme, spec, dtype)
        return results, kv

    runner = LayerwiseRunner(model, samples, opts.batch_size)
    with kv_observer(model) as kv_max:
        for i in tqdm(range(len(layers)), desc=f"quantize layers ({scheme.algorithm})"):
            parts = runner.parts(i)
            todo = {n: m for n, m in parts.linears.items() if n not in skip}
            if scheme.algorithm == "awq":
                results.update(
                    awq_layer(
                        runner,
                        i,
                        parts,
                        spec,
                        dtype,
                        n_grid=opts.awq_grid,
                        duo_scaling=opts.awq_duo_scaling,
                        skip=skip,
                    )
                )
            elif scheme.algorithm in ("gptq", "smoothquant+gptq"):
                if scheme.algorithm == "smoothquant+gptq":
                    smooth_layer(runner, i, parts, opts.smoothing_strength)
                # linears reading the same input (q/k/v, gate/up) share one Hessian
                source = {n: _input_group(parts, n) for n in todo}
                taps = {source[n]: m for n, m in todo.items()}
                acc = {g: HessianAccumulator(m.in_features) for g, m in taps.items()}
                with input_hooks(taps, lambda g, x, acc=acc: acc[g].add(x)):
                    runner.forward(i)
                hessians = {g: a.hessian() for g, a in acc.items()}
                for name, lin in todo.items():
                    q = gptq_quantize(
                        lin.weight.data,
                        hessians[source[name]],
                        spec,
                        dtype,
                        actorder=scheme.actorder,
                        damp=opts.damp,
                    )
                    _set_weight(lin, q.dequantize())
                    results[name] = q
                del acc, hessians
            elif scheme.kind == "fp8" and scheme.activations == "fp8-static":
                amax: dict[str, float] = {}

                def observe(n: str, x: torch.Tensor, amax: dict[str, float] = amax) -> None:
                    amax[n] = max(amax.get(n, 0.0), float(x.abs().max()))

                with input_hooks(todo, observe):
                    runner.forward(i)
                for name, lin in todo.items():
                    q = _quantize_direct(lin, scheme, spec, dtype)
                    q.input_scale = fp8_input_scale(amax[name], dtype)  # type: ignore[union-attr]
                    results[name] = q
            else:  # rtn / fp8-dynamic, calibrating only the KV cache
                for name, lin in todo.items():
                    results[name] = _quantize_direct(lin, scheme, spec, dtype)
            kv_max.clear()
            runner.forward(i, advance=True)  # the quantized layer feeds the next one
            if want_kv:
                k_max, v_max = kv_max.get(id(parts.attn), (0.0, 0.0))
                kv[f"{prefix}.{i}.self_attn"] = (k_max, v_max)
    return results, kv
