"""The engine flags `generate`, `chat` and `serve` share (add_engine_args), the EngineConfig they
make (engine_config), and memory sizes as flags take them (memory_size: 512M, 2G)."""

from __future__ import annotations

import argparse
from typing import Any

from edgellm.config import EngineConfig
from edgellm.registry import KV_CACHE_DTYPES


def memory_size(value: str) -> int:
    """Bytes, with an optional K/M/G/KiB/MiB/GiB suffix."""
    v = value.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    try:
        return int(float(v[:-1] if v[-1:] in "KMG" else v) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size: {value!r} (e.g. 512M, 2G)") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); "
        "for serve, also a served name from models.yaml",
    )
    g.add_argument(
        "--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)"
    )
    g.add_argument("--device", default="cpu", help="cpu | cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype, except fp16 on CPU where --cpu-quant auto runs integer dots "
        "(quantized weights); fp16: half the bytes of fp32 (F16C converts on the CPU); fp32; "
        "fp8: e4m3 with per-layer scales",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default=None,
        help="KV cache size in bytes (e.g. 1G); default: on CUDA what --gpu-memory-utilization "
        "leaves after a profile of the largest step, on CPU a fraction of free memory (<= 1G)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: the share of the GPU's memory for weights, activations and the KV cache "
        "(vLLM's flag; default 0.9)",
    )
    g.add_argument(
        "--cpu-quant",
        default=None,
        choices=["auto", "exact", "fast"],
        help="quantized weights on CPU: auto (the fastest this CPU has: integer dots over int8 "
        "activations, dense matmuls for large steps where measured faster), exact (dequantized "
        "once, fp32 matmuls: transformers' logits) or fast (torch's int4 GEMV and bf16 matmuls; "
        "for CPUs with bf16 units). Default: $EDGELLM_CPU_QUANT, else auto",
    )
    g.add_argument(
        "--cpu-isa",
        default=None,
        choices=["avx2", "avx512", "amx"],
        help="cap the instruction-set level of the CPU kernels (default: $EDGELLM_CPU_ISA, else "
        "what this CPU has)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: decode steps eagerly instead of as captured CUDA graphs (vLLM's flag; on by "
        "default until the graphs are checked on a GPU; --no-enforce-eager captures them)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='KV-cache events as vLLM publishes them, JSON: {"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", '
        '"replay_endpoint": ..., "topic": ...}',
    )
    g.add_argument("--chat-template", default=None, help="a Jinja chat template (file or string)")
    g.add_argument(
        "--architecture",
        default=None,
        help="override the checkpoint's architecture (llama, mistral, qwen2, phi3, exaone)",
    )


def _kv_events_config(text: str) -> Any:
    from edgellm.engine.kv_publisher import KVEventsConfig

    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": getattr(args, "gpu_memory_utilization", 0.9),
        "enforce_eager": getattr(args, "enforce_eager", True),
        "seed": args.seed,
        "chat_template": args.chat_template,
        "architecture": getattr(args, "architecture", None),
        "cpu_quant": getattr(args, "cpu_quant", None),
        "cpu_isa": getattr(args, "cpu_isa", None),
        "scheduling_policy": getattr(args, "scheduling_policy", "fcfs"),
        "kv_events": getattr(args, "kv_events_config", None),
    }
    fields.update(overrides)
    return EngineConfig(**fields)
