"""Configuration dataclasses: what the model is, and how the engine runs it.

ModelConfig is the normalized view of a checkpoint's config.json (or GGUF
metadata); EngineConfig holds the user's serving knobs. Both check themselves
in __post_init__ so a bad value fails at start-up with a clear message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from edgellm.registry import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from edgellm.engine.kv_publisher import KVEventsConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype | None, device: torch.device | str = "cpu") -> torch.dtype:
    """'auto' is float32 on CPU (CPUs without bf16 units emulate bf16 matmuls) and bfloat16 on
    CUDA."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; use float32, float16 or bfloat16")
        return value
    if value is None or value == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[value.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {value!r}; choose one of auto, float32, float16, bfloat16"
        ) from None


def kv_cache_torch_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device | str, cpu_fast: bool
) -> torch.dtype:
    """The KV cache's element type for kv_cache_dtype `name`: fp8 -> float8_e4m3fn, fp16 ->
    float16, fp32 -> float32; auto -> the model's dtype, except float16 for an fp32 model on CPU
    when `cpu_fast`: the load runs mode auto's integer dots (quantized weights, int8-rounded
    activations), beside which fp16 K/V cost nothing measurable, and the C++ attention converts
    fp16 pages exactly to fp32 with F16C (one instruction per 16 values), where at decode the
    page reads are what costs. Exact loads (mode exact, unquantized weights) keep fp32 pages,
    transformers' numbers.
    """
    if name.startswith("fp8"):
        return torch.float8_e4m3fn
    if name in ("fp16", "float16"):
        return torch.float16
    if name in ("fp32", "float32"):
        return torch.float32
    if cpu_fast and model_dtype == torch.float32 and torch.device(device).type == "cpu":
        return torch.float16
    return model_dtype


ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh", "gelu")
NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass
class ModelConfig:
    """One Llama-family decoder, whatever its checkpoint calls things."""

    architecture: str  # key into models.arch.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gate's activation: silu, gelu_pytorch_tanh (GeGLU), gelu
    # per layer: None (full attention) or the window size in tokens
    sliding_windows: list[int | None] = field(default_factory=list)
    # where the RMSNorms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma 3: before
    # and after each), "post" (EXAONE 4: after each, on the branch output)
    norm_layout: str = "pre"
    norm_weight_offset: float = 0.0  # Gemma: the norms scale by (offset + weight)
    qk_norm: bool = (
        False  # Qwen3, Gemma 3, EXAONE 4: an RMSNorm over each q and k head before rotary
    )
    embed_scale: float | None = None  # Gemma: embeddings multiplied by sqrt(hidden)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own (unscaled) rotary base
    nope_full_layers: bool = False  # EXAONE 4 hybrid: full-attention layers take no rotary
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"model config: activation {self.hidden_act!r} is not supported; "
                f"supported: {ACTIVATIONS}"
            )
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(
                f"model config: norm layout {self.norm_layout!r}; known: {NORM_LAYOUTS}"
            )
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("model config: one sliding window entry per layer expected")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class EngineConfig:
    """The serving knobs, named like vLLM's where the concept is the same."""

    model: str | None = None  # HF directory, .gguf file, or None for the embedded default
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own limit, capped by KV capacity
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; None: kv_cache_memory_fraction of free memory
    kv_cache_memory_fraction: float = 0.2  # CPU
    # CUDA: the share of the GPU for weights, the largest step's activations and the KV cache
    # (vLLM's --gpu-memory-utilization; edgellm/engine/memory_profile.py)
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # CUDA: run decode steps eagerly, not as captured CUDA graphs (vLLM's --enforce-eager;
    # edgellm/engine/cuda_graphs.py). On by default until the graphs have been checked on a GPU
    # (benchmarks/gpu_check.py); --no-enforce-eager captures them.
    enforce_eager: bool = True
    seed: int = 0
    tokenizer: str | None = None  # a directory with tokenizer files; default: the model's own
    chat_template: str | None = None  # a Jinja template string or path overriding the model's
    architecture: str | None = (
        None  # override the checkpoint's architecture (models.arch name or HF class)
    )
    # quantized linears on CPU: "auto", "exact" or "fast" (edgellm/platform.py); None:
    # $EDGELLM_CPU_QUANT, else auto
    cpu_quant: str | None = None
    cpu_isa: str | None = (
        None  # cap the CPU kernels' ISA level (avx2 | avx512 | amx); None: $EDGELLM_CPU_ISA
    )
    # "fcfs" or "priority" (requests' priority field: lower runs sooner; engine/request_queue.py)
    scheduling_policy: str = "fcfs"
    kv_events: KVEventsConfig | None = None  # --kv-events-config: publish KV-cache events (vLLM's)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.cpu_quant is not None and self.cpu_quant not in ("auto", "exact", "fast"):
            raise ValueError(f"cpu_quant must be auto, exact or fast, got {self.cpu_quant!r}")
        if self.cpu_isa is not None and self.cpu_isa not in ("avx2", "avx512", "amx"):
            raise ValueError(f"cpu_isa must be avx2, avx512 or amx, got {self.cpu_isa!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        self.torch_dtype = parse_dtype(self.dtype, self.device)
