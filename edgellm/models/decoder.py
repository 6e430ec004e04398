"""One Llama-family decoder for every supported architecture.

Module paths follow the Llama checkpoint layout with q/k/v fused into
qkv_proj and gate/up into gate_up_proj; models.arch maps each
architecture's checkpoint names onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgellm.batch import ForwardBatch
from edgellm.kernels import cpu_native
from edgellm.config import ModelConfig
from edgellm.layers.attention import Attention
from edgellm.layers.linear import Linear
from edgellm.layers.norm import RMSNorm
from edgellm.layers.rotary import RotaryEmbedding
from edgellm.models.arch import ARCHITECTURES
from edgellm.quant.schemes import QuantScheme, UnquantizedLinearMethod


def _checkpoint_names(cfg: ModelConfig, parent: str, fused: str) -> list[str]:
    """What the checkpoint (and its quantization ignore list) calls a fused module: q/k/v_proj, ..."""
    return [f"{parent}.{name}" for name in ARCHITECTURES[cfg.architecture].checkpoint_modules(fused)]


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: QuantScheme, dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{layer}.self_attn"
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
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
            cfg.q_size, cfg.hidden_size, cfg.o_bias, scheme.linear_method(f"{p}.o_proj"), dtype, f"{p}.o_proj"
        )
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer], layer)
        self.native_rotary = False  # CPU fast mode, full-width rotary: set by the loader
        # fp8 KV cache scales, when the checkpoint carries them (compressed-tensors kv_cache_scheme);
        # NaN = not given. Buffers, not parameters: optional for the loader.
        self.register_buffer("k_scale", torch.full((), float("nan")), persistent=False)
        self.register_buffer("v_scale", torch.full((), float("nan")), persistent=False)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.native_rotary and qkv.dtype == torch.float32 and qkv.dim() == 2 and qkv.stride(-1) == 1:
            # CPU fast mode: rotary in place on the projection (edgellm/kernels/cpu_native.rotate_)
            cos, sin = cos_sin
            cpu_native.rotate_(qkv, cos.reshape(qkv.shape[0], -1), sin.reshape(qkv.shape[0], -1),
                               self.num_heads + self.num_kv_heads, self.head_dim)
            q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(q, k, v, batch.attn).reshape(-1, self.q_size))
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads rotated together: one set of elementwise ops per layer instead of two
        qk = rotary.rotate(qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim), *cos_sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, batch.attn)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: QuantScheme, dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{layer}.mlp"
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
            cfg.mlp_bias,
            scheme.linear_method(f"{p}.gate_up_proj", _checkpoint_names(cfg, p, "gate_up_proj")),
            dtype,
            f"{p}.gate_up_proj",
        )
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
            scheme.linear_method(f"{p}.down_proj"), dtype, f"{p}.down_proj",
        )

    bf16_intermediate = False  # CPU fast mode with int4 kernels on both linears: set by the loader
    native_silu_mul = False  # ... and the C++ kernels built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_intermediate and x.shape[0] > 1:
            # the down projection rounds its input to bf16 anyway: keep gate/up and SiLU in bf16
            # instead of widening [T, 2 * intermediate] to fp32 and back (prefill-sized steps)
            gu = self.gate_up_proj(x.to(torch.bfloat16))
            if self.native_silu_mul:  # one pass, one rounding (edgellm/kernels/cpu_native.silu_mul)
                return self.down_proj(cpu_native.silu_mul(gu.reshape(-1, gu.shape[-1]))).to(x.dtype)
            gate, up = gu.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up).to(x.dtype)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, scheme: QuantScheme, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(cfg, layer, scheme, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, layer, scheme, dtype)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, cos_sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, scheme: QuantScheme, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, scheme, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor,
            cfg.max_position_embeddings,
        )

    fused = None  # fp32 on CPU: models/fused_decode.FusedDecode, set by the loader

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.cos_sin_for(batch.positions, batch.seq_total_lens, x.dtype)
        if self.fused is not None:
            y = self.fused(x, cos_sin, batch.attn)  # None: not a decode-only step
            if y is not None:
                return self.norm(y)
        for layer in self.layers:
            x = layer(x, self.rotary, cos_sin, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """The whole model: hidden states for a flattened step, logits for chosen rows."""

    def __init__(
        self, cfg: ModelConfig, scheme: QuantScheme, dtype: torch.dtype, max_position: int | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = DecoderModel(cfg, scheme, dtype, max_position or cfg.max_position_embeddings)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, UnquantizedLinearMethod(),
                                  dtype, "lm_head")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def use_fast_logits(self) -> None:
        """CPU "fast" mode: an int8 / bf16 logits head for argmax-only rows (edgellm/quant/backends.CpuFastLogitsHead)."""
        from edgellm.quant.backends import CpuFastLogitsHead

        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
        else:
            weight = getattr(self.lm_head, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
                return  # a quantized or non-fp32 head keeps its own kernel
        self.fast_logits = CpuFastLogitsHead(weight)

    def use_int_dot_logits(self, native) -> None:
        """CPU mode auto: an integer-dot logits head for argmax-only rows
        (edgellm/quant/linear_kernels/cpu_int_head.IntDotLogitsHead)."""
        from edgellm.quant.linear_kernels.cpu_int_head import IntDotLogitsHead

        weight = self.model.embed_tokens.weight if self.lm_head is None else getattr(self.lm_head, "weight", None)
        if isinstance(weight, torch.Tensor) and IntDotLogitsHead.can_implement(weight):
            self.fast_logits = IntDotLogitsHead(weight, native)

    fast_logits = None

    def compute_logits(self, hidden: torch.Tensor, argmax_only: list[bool] | None = None,
                       allowed: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]. argmax_only: per row, whether only its argmax matters
        (lets the CPU fast head approximate the tail); None: every logit of every row matters.
        allowed: row -> bool [vocab], greedy rows under a grammar whose masked argmax is all that
        matters (only where the head can do it: `supports_masked_argmax`); their disallowed logits
        come back -inf."""
        if allowed:
            flags = argmax_only or [False] * hidden.shape[0]
            others = [i for i in range(hidden.shape[0]) if i not in allowed]
            rows = sorted(allowed)
            out = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device)
            if others:
                idx = torch.tensor(others)
                out[idx] = self.compute_logits(hidden[idx], [flags[i] for i in others])
            idx = torch.tensor(rows)
            out[idx] = self.fast_logits.masked(hidden[idx], torch.stack([allowed[r] for r in rows]))  # type: ignore[union-attr]
            return out
        if self.fast_logits is not None:
            return self.fast_logits(hidden, argmax_only if argmax_only is not None else [False] * hidden.shape[0])
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @property
    def supports_masked_argmax(self) -> bool:
        return self.fast_logits is not None and getattr(self.fast_logits, "masked", None) is not None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
