"""The layer-by-layer reference forward of calibration, and input hooks.

The forward is transformers' own model, run one decoder layer at a time
(as GPTQ does): the inputs of layer 0 are captured once, each layer is
calibrated and quantized, then the *quantized* layer's outputs become the
next layer's inputs. Memory stays at one layer's activations for the
calibration set, whatever the depth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from edgellm.quant.decoder_parts import LayerParts, decoder_layers, layer_parts, norm_offset_of


@contextmanager
def input_hooks(
    modules: dict[str, nn.Module], fn: Callable[[str, torch.Tensor], None]
) -> Iterator[None]:
    """Call fn(name, input) for the first positional input of each module while active."""
    handles = [
        m.register_forward_pre_hook(lambda mod, args, _n=name: fn(_n, args[0].detach()))
        for name, m in modules.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _StopForward(Exception):
    pass


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class LayerwiseRunner:
    """Replays the calibration set through one decoder layer at a time.

    Each layer's keyword arguments (attention mask, rotary tables, ...) are recorded as that layer
    received them, from one run of the float model per batch shape (they depend on the shape, not
    on the tokens: no padding mask is passed); layers of different kinds (Gemma 3's and EXAONE
    4's sliding-window and global layers) take different ones. Other batches of a shape already
    seen stop at the first layer, whose input is all they add."""

    def __init__(self, model: nn.Module, samples: list[list[int]], batch_size: int = 8) -> None:
        self.model = model
        self.prefix, self.layers = decoder_layers(model)
        self.norm_offset = norm_offset_of(model)
        self.hidden: list[torch.Tensor] = []
        self.kwargs: list[list[dict[str, Any]]] = []  # [batch][layer]
        last = len(self.layers) - 1
        captured: dict[str, Any] = {}

        def catch(index: int) -> Callable:
            def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                kwargs = dict(kwargs)
                hidden = args[0] if args else kwargs.pop("hidden_states")
                if index == 0:
                    captured["hidden"] = hidden
                    if captured["known"]:
                        raise _StopForward
                captured["kwargs"].append(kwargs)
                if index == last:
                    raise _StopForward

            return hook

        handles = [
            layer.register_forward_pre_hook(catch(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        try:
            batches = [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
            by_shape: dict[tuple[int, ...], list[dict[str, Any]]] = {}
            for batch in tqdm(batches, desc="calibration: embed", leave=False):
                ids = torch.tensor(batch, dtype=torch.long)
                shape = tuple(ids.shape)
                captured["kwargs"], captured["known"] = [], shape in by_shape
                try:
                    with torch.no_grad():
                        model(input_ids=ids, use_cache=False)
                except _StopForward:
                    pass
                self.hidden.append(captured["hidden"].detach())
                self.kwargs.append(by_shape.setdefault(shape, captured["kwargs"]))
        finally:
            for h in handles:
                h.remove()

    def parts(self, index: int) -> LayerParts:
        return layer_parts(self.layers[index], f"{self.prefix}.{index}", self.norm_offset)

    @torch.no_grad()
    def forward(self, index: int, advance: bool = False) -> None:
        """Run every batch through layer `index` (hooks see its inputs); advance: keep outputs."""
        layer = self.layers[index]
        for b, (h, kw) in enumerate(zip(self.hidden, self.kwargs)):
            out = _layer_output(layer(h, **kw[index]))
            if advance:
                self.hidden[b] = out.detach()

    @torch.no_grad()
    def run_module(
        self, module: nn.Module, inputs: list[torch.Tensor], index: int | None = None
    ) -> list[torch.Tensor]:
        """Run a sub-module of a layer: self_attn of layer `index` with that layer's kwargs, or
        (index None) an MLP or a linear."""
        if index is None:
            return [module(x) for x in inputs]
        return [
            _layer_output(module(hidden_states=x, **kw[index]))
            for x, kw in zip(inputs, self.kwargs)
        ]
