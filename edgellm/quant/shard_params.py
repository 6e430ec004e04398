"""Helpers for formats' linear methods: a layer's parameters and the shards of a fused module.

Registering empty parameters, reading stashed tensors in shard order, the output rows of
each shard, freeing the on-disk tensors once a kernel holds its own, and act-order (g_idx)
int4 weights whose shards may each carry their own g_idx.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from edgellm.quant.int_codes import Int4Codes


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
