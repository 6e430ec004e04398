"""The decoder's blocks: self-attention (fused qkv, optional q/k norms, rotary or none), the gated
MLP (SiLU or tanh-GELU gate), the (optionally scaled) token embedding.

Module paths follow the Llama checkpoint layout with q/k/v fused into qkv_proj and gate/up into
gate_up_proj; models.arch maps each architecture's checkpoint names onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgellm.batch import ForwardBatch
from edgellm.config import ModelConfig
from edgellm.layer_ops import LayerOps
from edgellm.layers.attention import Attention
from edgellm.layers.linear import Linear
from edgellm.layers.norm import RMSNorm
from edgellm.layers.rotary import RotaryEmbedding
from edgellm.models.arch import ARCHITECTURES
from edgellm.quant.schemes import QuantScheme

CosSin = tuple[torch.Tensor, torch.Tensor]


def _checkpoint_names(cfg: ModelConfig, parent: str, fused: str) -> list[str]:
    """What the checkpoint (and its quantization ignore list) calls a fused module: q/k/v_proj,
    ..."""
    return [
        f"{parent}.{name}" for name in ARCHITECTURES[cfg.architecture].checkpoint_modules(fused)
    ]


class SelfAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        scheme: QuantScheme,
        dtype: torch.dtype,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        ops = ops or LayerOps()
        p = f"model.layers.{layer}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(
            cfg.hidden_size,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            cfg.qkv_bias,
            scheme.linear_method(f"{p}.qkv_proj", _checkpoint_names(cfg, p, "qkv_proj")),
            dtype,
            f"{p}.qkv_proj",
        )
        self.o_proj = Linear(
            cfg.q_size,
            cfg.hidden_size,
            cfg.o_bias,
            scheme.linear_method(f"{p}.o_proj"),
            dtype,
            f"{p}.o_proj",
        )
        # Qwen3 / Gemma 3 / EXAONE 4: one RMSNorm over each q and each k head, before rotary
        self.q_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset)
            if cfg.qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset)
            if cfg.qk_norm
            else None
        )
        self.attn = Attention(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.sliding_windows[layer],
            layer,
            cfg.attn_scale,
            ops.attention,
        )
        # C++ rotary in place on the projection (edgellm/kernels/csrc/cpu/rotary.cpp): full-width
        # rotary without q/k norms, where the load's ops have the C++ kernels
        full = int(cfg.head_dim * cfg.partial_rotary_factor) == cfg.head_dim
        self.native_rotary = ops.native if full and not cfg.qk_norm else None
        # fp8 KV cache scales, when the checkpoint carries them (compressed-tensors
        # kv_cache_scheme);
        # NaN = not given. Buffers, not parameters: optional for the loader.
        self.register_buffer("k_scale", torch.full((), float("nan")), persistent=False)
        self.register_buffer("v_scale", torch.full((), float("nan")), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """rotary None: a layer without positional rotation (EXAONE 4's global layers)."""
        qkv = self.qkv_proj(x)
        if (
            self.native_rotary is not None
            and rotary is not None
            and cos_sin is not None
            and qkv.dtype == torch.float32
            and qkv.dim() == 2
            and qkv.stride(-1) == 1
        ):
            cos, sin = cos_sin
            n = qkv.shape[0]
            self.native_rotary.rotate_(
                qkv,
                cos.reshape(n, -1).contiguous(),
                sin.reshape(n, -1).contiguous(),
                self.num_heads + self.num_kv_heads,
                self.head_dim,
            )
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                -1, self.num_kv_heads, self.head_dim
            )
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(q, k, v, batch.attn).reshape(-1, self.q_size))
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
            if rotary is not None and cos_sin is not None:
                q, k = rotary.apply(q, k, *cos_sin)
        else:
            qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
            qk = qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            if rotary is not None and cos_sin is not None:
                # q and k heads rotated together: one set of elementwise ops per layer instead of
                # two
                qk = rotary.rotate(qk, *cos_sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, batch.attn)
        return self.o_proj(o.reshape(-1, self.q_size))


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        scheme: QuantScheme,
        dtype: torch.dtype,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        ops = ops or LayerOps()
        p = f"model.layers.{layer}.mlp"
        self.intermediate_size = cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        self.gated_silu = cfg.hidden_act in ("silu", "swish")  # what the bf16 paths implement
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
            cfg.mlp_bias,
            scheme.linear_method(f"{p}.gate_up_proj", _checkpoint_names(cfg, p, "gate_up_proj")),
            dtype,
            f"{p}.gate_up_proj",
        )
        self.down_proj = Linear(
            cfg.intermediate_size,
            cfg.hidden_size,
            cfg.mlp_bias,
            scheme.linear_method(f"{p}.down_proj"),
            dtype,
            f"{p}.down_proj",
        )

        # a bf16 intermediate (the load's ops allow it: CPU fast mode, or auto with bf16 units; a
        # gated SiLU without biases): taken by a step whose two linears' kernels round their input
        # to bf16 at its row count anyway (rounds_to_bf16); SiLU-and-mul in C++ when built
        self.bf16_intermediate = ops.bf16_mlp and self.gated_silu and not cfg.mlp_bias
        self.native_silu_mul = ops.native if self.bf16_intermediate else None
        # fp32 steps of more than one row: SiLU-and-mul in one C++ pass when built
        self.native_act = ops.native if self.gated_silu else None

    def _bf16_step(self, rows: int) -> bool:
        def rounds(linear: Linear) -> bool:
            test = getattr(getattr(linear, "kernel", None), "rounds_to_bf16", None)
            return test is not None and test(rows)

        return (
            self.bf16_intermediate
            and rows > 1
            and rounds(self.gate_up_proj)
            and rounds(self.down_proj)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_step(x.numel() // x.shape[-1]):
            # the down projection rounds its input to bf16 anyway: keep gate/up and SiLU in bf16
            # instead of widening [T, 2 * intermediate] to fp32 and back (prefill-sized steps)
            gu = self.gate_up_proj(x.to(torch.bfloat16))
            if self.native_silu_mul is not None:  # one pass, one rounding (csrc/cpu/activation.cpp)
                return self.down_proj(
                    self.native_silu_mul.silu_mul(gu.reshape(-1, gu.shape[-1]))
                ).to(x.dtype)
            gate, up = gu.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up).to(x.dtype)
        gu = self.gate_up_proj(x)
        if self.native_act is not None and gu.dtype == torch.float32 and gu.dim() == 2:
            return self.down_proj(self.native_act.silu_mul_f32(gu))
        gate, up = gu.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Embedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, scale: float | None = None
    ) -> None:
        """scale: a multiplier of every embedding (Gemma: sqrt(hidden)), applied in the model's
        dtype."""
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
