"""One decoder for every supported architecture: Llama's, with what the others add switched on
by the ModelConfig (norms before, around or after each branch; q/k norms; a scaled embedding;
sliding layers with their own rotary base or global layers without rotary; logit soft-capping).

Module paths follow the Llama checkpoint layout (blocks.py); models.arch maps each
architecture's checkpoint names onto them.
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
from edgellm.models.blocks import MLP, CosSin, Embedding, SelfAttention
from edgellm.quant.linear_method import UnquantizedLinearMethod
from edgellm.quant.schemes import QuantScheme


class DecoderLayer(nn.Module):
    """norm_layout "pre": x + attn(norm(x)), then x + mlp(norm(x)) (input_layernorm,
    post_attention_layernorm); "sandwich" adds attn_output_norm and mlp_output_norm on each
    branch's output; "post" has only those two."""

    def __init__(
        self, cfg: ModelConfig, layer: int, scheme: QuantScheme, dtype: torch.dtype, ops: LayerOps
    ) -> None:
        super().__init__()

        def norm(present: bool) -> RMSNorm | None:
            return (
                RMSNorm(
                    cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset, ops.native
                )
                if present
                else None
            )

        self.input_layernorm = norm(cfg.norm_layout != "post")
        self.self_attn = SelfAttention(cfg, layer, scheme, dtype, ops)
        self.attn_output_norm = norm(cfg.norm_layout != "pre")
        self.post_attention_layernorm = norm(cfg.norm_layout != "post")
        self.mlp = MLP(cfg, layer, scheme, dtype, ops)
        self.mlp_output_norm = norm(cfg.norm_layout != "pre")

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        h = self.self_attn(
            x if self.input_layernorm is None else self.input_layernorm(x), rotary, cos_sin, batch
        )
        x = x + (h if self.attn_output_norm is None else self.attn_output_norm(h))
        h = self.mlp(
            x if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
        )
        return x + (h if self.mlp_output_norm is None else self.mlp_output_norm(h))


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        scheme: QuantScheme,
        dtype: torch.dtype,
        max_position: int,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        ops = ops or LayerOps()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, cfg.embed_scale)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, scheme, dtype, ops) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_weight_offset, ops.native
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            max_position,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.partial_rotary_factor,
            cfg.max_position_embeddings,
        )
        # Gemma 3: sliding layers rotate with their own base, unscaled
        self.local_rotary = (
            None
            if cfg.local_rope_theta is None
            else RotaryEmbedding(
                cfg.head_dim,
                max_position,
                cfg.local_rope_theta,
                None,
                cfg.partial_rotary_factor,
                cfg.max_position_embeddings,
            )
        )
        # per layer: 0 the rotary above, 1 the local one, -1 none (EXAONE 4's hybrid global layers)
        self.layer_rotary = [
            1
            if w is not None and self.local_rotary is not None
            else -1
            if w is None and cfg.nope_full_layers
            else 0
            for w in cfg.sliding_windows
        ]

    fused = None  # fp32 on CPU: models/fused_decode.FusedDecode, set by the loader

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.cos_sin_for(batch.positions, batch.seq_total_lens, x.dtype)
        local = (
            None
            if self.local_rotary is None
            else self.local_rotary.cos_sin_for(batch.positions, batch.seq_total_lens, x.dtype)
        )
        if self.fused is not None:
            y = self.fused(x, cos_sin, batch.attn, local)  # None: not a decode-only step
            if y is not None:
                return self.norm(y)
        rotaries: list[tuple[RotaryEmbedding | None, CosSin | None]] = [(self.rotary, cos_sin)]
        if local is not None:
            rotaries.append((self.local_rotary, local))
        for layer, which in zip(self.layers, self.layer_rotary):
            rotary, cs = rotaries[which] if which >= 0 else (None, None)
            x = layer(x, rotary, cs, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """The whole model: hidden states for a flattened step, logits for chosen rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        scheme: QuantScheme,
        dtype: torch.dtype,
        max_position: int | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        """ops: what the layers run (edgellm/layer_ops.py; None: plain torch)."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = DecoderModel(
            cfg, scheme, dtype, max_position or cfg.max_position_embeddings, ops
        )
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, False, UnquantizedLinearMethod(), dtype, "lm_head"
            )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def use_fast_logits(self, packed_bf16: bool) -> None:
        """CPU "fast" mode: an int8 / bf16 logits head for argmax-only rows
        (edgellm/quant/linear_kernels/cpu_fast_head.CpuFastLogitsHead)."""
        from edgellm.quant.linear_kernels.cpu_fast_head import CpuFastLogitsHead

        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
        else:
            weight = getattr(self.lm_head, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
                return  # a quantized or non-fp32 head keeps its own kernel
        self.fast_logits = CpuFastLogitsHead(weight, packed_bf16)

    def use_int_dot_logits(self, native, n16: bool = False) -> None:
        """CPU mode auto: an integer-dot logits head for argmax-only rows
        (edgellm/quant/linear_kernels/cpu_int_head.IntDotLogitsHead; n16: in the interleaved layout
        of VNNI CPUs, its AMX crossover measured)."""
        from edgellm.quant.linear_kernels.cpu_int_head import IntDotLogitsHead

        weight = (
            self.model.embed_tokens.weight
            if self.lm_head is None
            else getattr(self.lm_head, "weight", None)
        )
        if isinstance(weight, torch.Tensor) and IntDotLogitsHead.can_implement(weight):
            self.fast_logits = IntDotLogitsHead(weight, native, n16)
            self.fast_logits.calibrate()

    fast_logits = None

    def compute_logits(
        self,
        hidden: torch.Tensor,
        argmax_only: list[bool] | None = None,
        allowed: dict[int, torch.Tensor] | None = None,
        sampling: list[bool] | None = None,
    ) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]. argmax_only: per row, whether only its argmax matters
        (lets the CPU fast head approximate the tail); None: every logit of every row matters.
        sampling: per row, whether its logits only feed a sampler at a temperature (the CPU fast
        heads give those their approximate product; None: no such row).
        allowed: row -> int32 [ceil(vocab / 32)] token bitmask (set bit = allowed; xgrammar's
        layout), greedy rows under a grammar whose masked argmax is all that
        matters (only where the head can do it: `supports_masked_argmax`); their disallowed logits
        come back -inf."""
        logits = self._logits(hidden, argmax_only, allowed, sampling)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        # cap * tanh(logits / cap), as transformers computes it; masked (-inf) logits stay -inf
        return torch.where(torch.isfinite(logits), torch.tanh(logits / cap) * cap, logits)

    def _logits(
        self,
        hidden: torch.Tensor,
        argmax_only: list[bool] | None,
        allowed: dict[int, torch.Tensor] | None,
        sampling: list[bool] | None = None,
    ) -> torch.Tensor:
        if allowed:
            flags = argmax_only or [False] * hidden.shape[0]
            sampled = sampling or [False] * hidden.shape[0]
            others = [i for i in range(hidden.shape[0]) if i not in allowed]
            rows = sorted(allowed)
            out = torch.empty(
                hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device
            )
            if others:
                idx = torch.tensor(others)
                out[idx] = self._logits(
                    hidden[idx], [flags[i] for i in others], None, [sampled[i] for i in others]
                )
            idx = torch.tensor(rows)
            out[idx] = self.fast_logits.masked(hidden[idx], torch.stack([allowed[r] for r in rows]))  # type: ignore[union-attr]
            return out
        if self.fast_logits is not None:
            return self.fast_logits(
                hidden,
                argmax_only if argmax_only is not None else [False] * hidden.shape[0],
                sampling,
            )
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @property
    def supports_masked_argmax(self) -> bool:
        return (
            self.fast_logits is not None and getattr(self.fast_logits, "masked", None) is not None
        )

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
