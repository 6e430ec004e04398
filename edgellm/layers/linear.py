"""Linear layers. The parameters and the matmul belong to a LinearMethod from
the quant scheme; this module only knows its shards (for fused modules) and
loads each checkpoint tensor into the right slice (or, for layouts marked
`stash`, keeps it per shard for the method to assemble after loading)."""

from __future__ import annotations

import torch
from torch import nn

from edgellm.quant.linear_method import LinearMethod, ParamLayout


class Linear(nn.Module):
    """y = x W^T (+ b); optionally the concatenation of named shards (qkv, gate_up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: dict[str, int] | int,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if isinstance(output_sizes, int):
            output_sizes = {"": output_sizes}
        self.prefix = prefix
        self.input_size = input_size
        self.shard_sizes = dict(output_sizes)
        self.output_size = sum(self.shard_sizes.values())
        self.dtype = dtype
        self.device = torch.empty(0).device  # where the model is being built (torch.device context)
        self.method = method
        # param -> shard ("" = whole) -> tensor, for layouts with stash=True
        self.stash: dict[str, dict[str, torch.Tensor]] = {}
        self.layouts: dict[str, ParamLayout] = method.create_weights(
            self, input_size, self.output_size, dtype
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size, dtype=dtype), requires_grad=False
            )
            self.layouts["bias"] = ParamLayout(output_dim=0)
        else:
            self.bias = None
        self.loaded: set[tuple[str, str]] = set()

    @property
    def shards(self) -> list[str]:
        return [s for s in self.shard_sizes if s]

    def expected(self) -> set[tuple[str, str]]:
        """(param, shard) pairs a checkpoint must provide; shard '' is the whole tensor."""
        shards = self.shards or [""]
        return {(p, s) for p, layout in self.layouts.items() if not layout.optional for s in shards}

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None, source: str) -> None:
        """Copy one checkpoint tensor (the whole parameter, or one shard of it) into place."""
        if param_name == "bias" and "bias" not in self.layouts:
            # some writers (GPTQ) store an all-zero bias for layers that have none
            if torch.count_nonzero(tensor):
                raise ValueError(
                    f"{source}: {self.prefix} has no bias in this architecture, "
                    f"but the checkpoint gives a nonzero one"
                )
            return
        if param_name not in self.layouts:
            raise ValueError(
                f"{source}: unexpected tensor for {self.prefix} (no parameter {param_name!r})"
            )
        if shard and shard not in self.shard_sizes:
            raise ValueError(f"{source}: {self.prefix} has no shard {shard!r}")
        layout = self.layouts[param_name]
        if layout.stash:
            parts = self.stash.setdefault(param_name, {})
            if (shard or "") in parts:
                raise ValueError(f"{source}: {self.prefix}.{param_name} given twice")
            parts[shard or ""] = tensor
        else:
            self._copy_into(param_name, layout, tensor, shard, source)
        if shard:
            self.loaded.add((param_name, shard))
        else:
            self.loaded.update((param_name, s) for s in (self.shards or [""]))

    def _copy_into(
        self,
        param_name: str,
        layout: ParamLayout,
        tensor: torch.Tensor,
        shard: str | None,
        source: str,
    ) -> None:
        param: torch.Tensor = getattr(self, param_name)
        target = param.data
        if shard and layout.output_dim is not None:
            offset = 0
            for name, size in self.shard_sizes.items():
                if name == shard:
                    break
                offset += size
            size = self.shard_sizes[shard]
            target = target.narrow(
                layout.output_dim, offset // layout.pack_factor, size // layout.pack_factor
            )
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{source}: shape {tuple(tensor.shape)} does not match {self.prefix}.{param_name}"
                f"{'[' + shard + ']' if shard else ''} {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)
