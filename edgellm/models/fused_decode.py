"""fp32 models on CPU (every --cpu-quant mode): a decode-only step through every decoder layer
in one C++ call (edgellm/kernels/csrc/cpu/decode_layers.cpp).

The layer-by-layer path runs ~40 small torch ops per layer; at batch 1 their Python and
dispatcher cost was half of a decode step of SmolLM2-135M. The fused call does the same
math with the same matmul ops (integer dots, int4 GEMV, bf16 or fp32 dense, chosen by rows
exactly as the Python kernels do: edgellm/quant/linear_kernels/cpu_int.CpuIntDotKernel,
edgellm/quant/linear_kernels/cpu_fast.CpuInt4Kernel) and hand-written loops for the rest. On the
exact path
(fp32 weights) it agrees with the layers to fp32 summation-order noise (~1e-6), which is
also how far the layer path is from transformers.

It applies when every linear of every layer is a CPU int4 kernel without an act-order
permutation (the tinygemm one with its dense copy kept), an integer-dot kernel, or a plain fp32
matrix; the model runs fp32; rotary covers the whole head (per layer the model's table, the local
one, or none); the norms are any of the decoder's layouts (pre, sandwich, post; q/k norms) and the
gate SiLU or tanh-GELU; and at call time the step is decode-only over fp32 or fp8 (e4m3, per-layer
scales) KV caches. Anything else (prefill chunks, other formats) takes the layer path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from edgellm.batch import AttentionMetadata
from edgellm.kernels import cpu_native

if TYPE_CHECKING:
    from edgellm.models.decoder import DecoderModel

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.int64)
_CACHE_DTYPES = (torch.float32, torch.float16, torch.float8_e4m3fn)


# One linear in the per-layer list (edgellm/kernels/csrc/cpu/decode_layers.h declares the same
# layout):
# LINEAR_TENSORS tensors (a, b, c, dense, bias) and LINEAR_META ints (kind, group, max_rows,
# out_features, amx_rows, zero; the last three for the n16 kinds only).
LINEAR_DENSE, LINEAR_TINYGEMM, LINEAR_INT_DOT, LINEAR_INT8_DOT, LINEAR_INT_N16, LINEAR_INT8_N16 = (
    0,
    1,
    2,
    3,
    4,
    5,
)
LINEAR_KINDS = [
    LINEAR_DENSE,
    LINEAR_TINYGEMM,
    LINEAR_INT_DOT,
    LINEAR_INT8_DOT,
    LINEAR_INT_N16,
    LINEAR_INT8_N16,
]
LINEAR_TENSORS, LINEAR_META = 5, 6
META_PER_LAYER = 4 * LINEAR_META + 2  # the 4 linears', the sliding window, the rotary table
ACT_SILU, ACT_GELU_TANH = 0, 1
_ACTS = {
    "silu": ACT_SILU,
    "swish": ACT_SILU,
    "gelu_pytorch_tanh": ACT_GELU_TANH,
    "gelu_tanh": ACT_GELU_TANH,
}


def _linear_tensors(module) -> tuple[list[torch.Tensor], list[int]] | None:
    """One Linear's tensors and meta for the fused pass, or None if it cannot run there:
    tinygemm int4 (packed, scale_zero, -, dense, bias), int-dot int4 or int8 (qweight, scale,
    offset or empty, dense or empty, bias) or a plain fp32 matrix (-, -, -, weight, bias)."""
    from edgellm.quant.linear_kernels.cpu_fast import CpuInt4Kernel
    from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel
    from edgellm.quant.linear_kernels.dense import DenseKernel

    bias = module.bias if isinstance(getattr(module, "bias", None), torch.Tensor) else _EMPTY
    if bias.numel() and bias.dtype != torch.float32:
        return None
    kernel = getattr(module, "kernel", None)
    if isinstance(kernel, CpuInt4Kernel):
        if kernel.perm is not None or kernel.dense_weight is None:
            return None
        return (
            [kernel.packed, kernel.scale_zero, _EMPTY, kernel.dense_weight, bias],
            [LINEAR_TINYGEMM, kernel.tinygemm_group, kernel.gemv_max_rows, 0, 0, 0],
        )
    if isinstance(kernel, CpuIntDotKernel):
        if kernel.perm is not None:
            return None
        dense = _EMPTY if kernel.dense is None else kernel.dense
        max_rows = min(kernel.max_rows, 1 << 30)
        if kernel.n16:
            kind = LINEAR_INT_N16 if kernel.bits == 4 else LINEAR_INT8_N16
            return (
                [kernel.qweight, kernel.scale, kernel.offset, dense, bias],
                [
                    kind,
                    kernel.group,
                    max_rows,
                    kernel.n,
                    min(kernel.amx_rows, 1 << 30),
                    kernel.zero,
                ],
            )
        kind = LINEAR_INT_DOT if kernel.bits == 4 else LINEAR_INT8_DOT
        return [kernel.qweight, kernel.scale, kernel.offset, dense, bias], [
            kind,
            kernel.group,
            max_rows,
            0,
            0,
            0,
        ]
    weight = kernel.weight if isinstance(kernel, DenseKernel) else getattr(module, "weight", None)
    if kernel is not None and not isinstance(kernel, DenseKernel):
        return None
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
    ):
        return None
    return [_EMPTY, _EMPTY, _EMPTY, weight, bias], [LINEAR_DENSE, 0, 0, 0, 0, 0]


def _norm(norm) -> torch.Tensor | None:
    """An RMSNorm's (offset-folded) fp32 weight, the empty tensor for an absent norm, None if not
    fp32."""
    if norm is None:
        return _EMPTY
    if norm.weight.dtype != torch.float32 or norm.weight_offset:
        return None
    return norm.weight.detach()


class FusedDecode:
    def __init__(
        self, model: DecoderModel, static: list[list[torch.Tensor]], meta: list[int], native: Any
    ) -> None:
        first = model.layers[0].self_attn
        self.model = model
        self.native = native
        self.static = static
        self.meta = meta
        self.num_heads, self.num_kv_heads, self.head_dim = (
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
        )
        self.intermediate = model.layers[0].mlp.intermediate_size
        self.eps = model.norm.eps  # every norm of the model has the config's rms_norm_eps
        self.scale = first.attn.scale
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.activation = _ACTS[model.layers[0].mlp.hidden_act]
        self._weights: list[torch.Tensor] | None = None
        self._kv_scales: list[float] = []
        self._caches: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: DecoderModel, native: Any) -> FusedDecode | None:
        """The fused pass for this model over the C++ module `native` (None: not built), or None
        (logged) when some layer does not fit it."""
        why = None
        if native is None:
            why = "the C++ kernels did not build"
        elif model.embed_tokens.weight.dtype != torch.float32:
            why = "the model is not fp32"
        elif any(
            r is not None and r.rot_dim != model.layers[0].self_attn.head_dim
            for r in (model.rotary, model.local_rotary)
        ):
            why = "partial rotary"
        elif model.layers[0].mlp.hidden_act not in _ACTS:
            why = f"the MLP activation {model.layers[0].mlp.hidden_act!r}"
        static, meta = [], []
        for layer, which in zip(model.layers, model.layer_rotary) if why is None else []:
            sa, mlp = layer.self_attn, layer.mlp
            norms = [
                _norm(n)
                for n in (
                    layer.input_layernorm,
                    sa.q_norm,
                    sa.k_norm,
                    layer.attn_output_norm,
                    layer.post_attention_layernorm,
                    layer.mlp_output_norm,
                )
            ]
            if any(n is None for n in norms):
                why = "norm weights not fp32"
                break
            parts = [
                _linear_tensors(m)
                for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            if any(p is None for p in parts):
                why = (
                    f"{sa.qkv_proj.prefix.rsplit('.', 2)[0]}: a linear the fused pass does not run"
                )
                break
            (qkv, mq), (o, mo), (gu, mg), (down, md) = parts
            static.append([*norms[:3], *qkv, *o, norms[3], norms[4], *gu, *down, norms[5]])
            meta.extend([*mq, *mo, *mg, *md, int(sa.attn.sliding_window or 0), int(which)])
        if why is not None:
            logger.info("fused CPU decode off: %s; decoding layer by layer", why)
            return None
        kinds = [*LINEAR_KINDS, ACT_SILU, ACT_GELU_TANH]
        if native.layout() != [
            len(static[0]) + 1,
            len(meta) // len(static),
            LINEAR_TENSORS,
            LINEAR_META,
            *kinds,
        ]:
            raise RuntimeError(
                f"fused decode: the C++ module's per-layer layout {native.layout()} is not this one"
            )
        return cls(model, static, meta, native)

    def _weights_for(self, caches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[float]]:
        """The per-layer tensors with each layer's cache, and the K/V scales, rebuilt only when the
        caches are rebound (fp8 scales are final by the time a step reaches the fused pass)."""
        ids = tuple(id(c) for c in caches)
        if self._weights is None or ids != self._caches:
            self._weights = [
                t for static, cache in zip(self.static, caches) for t in (*static, cache)
            ]
            self._kv_scales = [float(v) for a in self.attns for v in (a.k_scale, a.v_scale)]
            self._caches = ids
        return self._weights, self._kv_scales

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states after the last layer (before the final norm), or None: not a step it runs.
        local_cos_sin: the sliding layers' own table (DecoderModel.local_rotary) when it has one."""
        if (
            meta.num_decodes != len(meta.seq_lens)
            or x.dtype != torch.float32
            or x.device.type != "cpu"
        ):
            return None
        caches = [a.kv_cache for a in self.attns]
        if any(c is None or c.dtype not in _CACHE_DTYPES or not c.is_contiguous() for c in caches):
            return None
        if caches[0].dtype == torch.float8_e4m3fn and not all(a.scales_known for a in self.attns):
            return None  # the first prefill sets them (layers/attention.py)
        rows = x.shape[0]
        cos, sin = (t.reshape(rows, self.head_dim).contiguous() for t in cos_sin)
        local_cos, local_sin = (
            (t.reshape(rows, self.head_dim).contiguous() for t in local_cos_sin)
            if local_cos_sin is not None
            else (_EMPTY, _EMPTY)
        )
        tables, lens = cpu_native.decode_tables(meta.block_tables, meta.seq_lens, rows)
        window_slots, window_tables = _EMPTY_LONG, _EMPTY_LONG
        if meta.window is not None:  # the sliding layers' own pool (engine/window_blocks.py)
            window_slots = meta.window.slot_mapping.long()
            window_tables, _ = cpu_native.decode_tables(
                meta.window.block_tables, meta.seq_lens, rows
            )
        weights, kv_scales = self._weights_for(caches)
        return self.native.decode_layers(
            x.contiguous(),
            cos,
            sin,
            local_cos,
            local_sin,
            meta.slot_mapping.long(),
            tables,
            lens,
            window_slots,
            window_tables,
            weights,
            self.meta,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            float(self.eps),
            float(self.scale),
            self.activation,
            kv_scales,
        )
