"""The Triton GEMMs on a GPU, timed against cuBLAS and checked against their torch references:
the model shapes they run at (`MODELS`, `DRY_MODELS` for the interpreter), `bench` (median time
of a call), `ceilings` (the GPU's copy bandwidth and fp16 matmul rate), `gemm_rows` (W4A16,
W8A16, FP8 and GGUF's kept-quantized forms per linear of each model), the table both GPU
scripts print and `worst_error`. Paged attention and the KV write are in `gpu_attention`.

Each kernel is measured in its own try: a kernel that fails (to compile, say) gives a row with
its error, and the other kernels still run. A deadline (time.monotonic()) stops a sweep early.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

# (name, hidden, intermediate, q heads, kv heads, head_dim)
Shape = tuple[str, int, int, int, int, int]
MODELS: list[Shape] = [
    ("phi-3.5-mini", 3072, 8192, 32, 32, 96),
    ("llama-3.1-8b", 4096, 14336, 32, 8, 128),
    ("qwen3-4b", 2560, 9728, 32, 8, 128),
]
DRY_MODELS: list[Shape] = [("tiny", 64, 96, 4, 2, 32)]
GEMM_KINDS = ("w4a16", "w8a16", "fp8", "q4_k w4 offsets", "q6_k w8 grouped")


def parse_shape(text: str) -> Shape:
    """'NAME:hidden,intermediate,q_heads,kv_heads,head_dim' -> a Shape."""
    name, _, dims = text.partition(":")
    values = [int(v) for v in dims.split(",")]
    if not name or len(values) != 5:
        raise ValueError(f"shape {text!r}: NAME:hidden,intermediate,q_heads,kv_heads,head_dim")
    return (name, *values)  # type: ignore[return-value]


def bench(fn: Callable[[], Any], warmup: int = 5, iters: int = 30) -> float:
    """Median seconds per call (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def ceilings(dev: torch.device) -> dict[str, float]:
    """The GPU's copy bandwidth (read + write bytes of a 512 MiB copy) and fp16 matmul rate."""
    a = torch.empty(1 << 28, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), 3, 10)
    x = torch.randn(8192, 8192, dtype=torch.float16, device=dev)
    tm = bench(lambda: x @ x, 3, 10)
    return {
        "copy_GBps": 2 * a.numel() * 2 / t / 1e9,
        "fp16_matmul_TFLOPs": 2 * 8192**3 / tm / 1e12,
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max absolute error over the reference's max magnitude."""
    scale = want.float().abs().max().clamp_min(1e-6)
    return float((got.float() - want.float()).abs().max() / scale)


def measured(row: dict[str, Any], run: Callable[[], tuple[float, float]]) -> dict[str, Any]:
    """row + {"us", "max_rel_err"} from run() -> (seconds, error), or + {"error"} when it
    raises (the sweep goes on)."""
    try:
        t, err = run()
    except Exception as exc:  # noqa: BLE001  (a failing kernel is a result, not the end)
        return {
            **row,
            "us": math.nan,
            "max_rel_err": math.nan,
            "error": f"{type(exc).__name__}: {exc}",
        }
    return {**row, "us": t * 1e6, "max_rel_err": err}


def _linears(hidden: int, inter: int, hq: int, hkv: int, hd: int) -> dict[str, tuple[int, int]]:
    return {
        "qkv": ((hq + 2 * hkv) * hd, hidden),
        "o": (hidden, hq * hd),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def _weights(n: int, k: int, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Random weights of every GEMM kind for one [N, K] linear, with their dense references."""
    from edgellm.kernels.int4_layouts import repack_int4, unpack_int4_weight

    g = 128 if k % 128 == 0 else 32
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
    zeros = torch.randint(4, 12, (n, k // g), device=dev, dtype=torch.int32)
    scales = (torch.rand(n, k // g, device=dev) * 0.02 + 0.005).to(dtype)
    w4 = repack_int4(q, zeros, scales, g)
    # GGUF's kept-quantized forms: Q4_K (int4, groups of 32 with offsets), Q6_K (int8 codes, 16)
    off = torch.randn(n, k // 32, device=dev) * 0.01
    k_scales = (torch.rand(n, k // 32, device=dev) * 0.02).float()
    wk = repack_int4(q, None, k_scales, 32, offsets=off)
    return {
        "w_ref": unpack_int4_weight(w4).to(dtype),
        "w4": w4,
        "w4_bytes": n * k // 2 + scales.numel() * 2,
        "w8": torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8),
        "s8": (torch.rand(n, 1, device=dev) * 0.01 + 1e-3).to(dtype),
        "w_fp8": (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn),
        "s_fp8": (torch.rand(n, 1, device=dev) * 0.01 + 1e-3).float(),
        "wk": wk,
        "wk_ref": unpack_int4_weight(wk).to(dtype),
        "c6": torch.randint(-32, 32, (n, k), device=dev, dtype=torch.int8),
        "s6": torch.rand(k // 16, n, device=dev) * 0.01,
    }


def _kernels(x: torch.Tensor, w: dict[str, Any], iters: int) -> dict[str, tuple[Callable, int]]:
    """kind -> (run() -> (seconds, error), weight bytes read)."""
    from edgellm.kernels.dequant_gemm import w4a16_gemm
    from edgellm.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
    from edgellm.kernels.grouped_gemm import w8g_gemm, w8g_gemm_ref
    from edgellm.kernels.int8_gemm import w8a16_gemm

    n, k = w["w8"].shape

    def timed(fn: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor]) -> Callable:
        return lambda: (bench(fn, iters=iters), rel_err(fn(), ref()))

    w4, wk, w8, s8 = w["w4"], w["wk"], w["w8"], w["s8"]
    return {
        "w4a16": (
            timed(lambda: w4a16_gemm(x, **vars(w4)), lambda: x @ w["w_ref"].t()),
            w["w4_bytes"],
        ),
        "w8a16": (
            timed(lambda: w8a16_gemm(x, w8, s8), lambda: x @ (w8.to(x.dtype) * s8).t()),
            n * k,
        ),
        "fp8": (
            timed(
                lambda: fp8_gemm(x, w["w_fp8"], w["s_fp8"]),
                lambda: fp8_gemm_ref(x, w["w_fp8"], w["s_fp8"]),
            ),
            n * k,
        ),
        "q4_k w4 offsets": (
            timed(lambda: w4a16_gemm(x, **vars(wk)), lambda: x @ w["wk_ref"].t()),
            n * k // 2 + n * k // 32 * 8,
        ),
        "q6_k w8 grouped": (
            timed(
                lambda: w8g_gemm(x, w["c6"], w["s6"], 16),
                lambda: w8g_gemm_ref(x, w["c6"], w["s6"], 16),
            ),
            n * k + n * k // 16 * 4,
        ),
    }


def gemm_rows(
    models: list[Shape],
    ms: list[int],
    dev: torch.device,
    dtype: torch.dtype,
    iters: int,
    kinds: tuple[str, ...] = GEMM_KINDS,
    deadline: float = math.inf,
) -> list[dict[str, Any]]:
    """For each M (the smallest first), model and linear: cuBLAS fp16 and each kernel of
    `kinds`, with time, GB/s, TFLOP/s, speedup over cuBLAS and max error against the reference.
    A model whose weights cannot be built gives one row with the error."""
    rows: list[dict[str, Any]] = []
    for m in sorted(ms):
        for name, hidden, inter, hq, hkv, hd in models:
            for layer, (n, k) in _linears(hidden, inter, hq, hkv, hd).items():
                if time.monotonic() > deadline:
                    return rows
                base = {"model": name, "op": f"gemm {layer}", "M": m, "N": n, "K": k}
                try:
                    w = _weights(n, k, dev, dtype)
                    x = torch.randn(m, k, device=dev, dtype=dtype)
                except Exception as exc:  # noqa: BLE001
                    rows.append(measured({**base, "kernel": "setup"}, lambda e=exc: _raise(e)))
                    continue
                ref = measured(
                    {**base, "kernel": "fp16 cuBLAS"}, lambda x=x, w=w: (_dense(x, w, iters), 0.0)
                )
                t_ref = ref["us"]
                group = [(ref, n * k * 2)]
                kernels = _kernels(x, w, iters)
                for kind in kinds:
                    run, wbytes = kernels[kind]
                    group.append((measured({**base, "kernel": kind}, run), wbytes))
                for row, wbytes in group:
                    t = row["us"] / 1e6
                    row["GBps"] = (wbytes + m * k * 2 + m * n * 2) / t / 1e9
                    row["TFLOPs"] = 2 * m * n * k / t / 1e12
                    row["speedup_vs_fp16"] = t_ref / row["us"]
                    rows.append(row)
    return rows


def _dense(x: torch.Tensor, w: dict[str, Any], iters: int) -> float:
    return bench(lambda: x @ w["w_ref"].t(), iters=iters)


def _raise(exc: Exception) -> tuple[float, float]:
    raise exc


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The kernel rows as printed lines (an error row shows its error)."""
    lines = [
        f"{'model':14s} {'op':34s} {'M':>5s} {'kernel':24s} {'us':>9s} {'GB/s':>8s} "
        f"{'TFLOP/s':>8s} {'x base':>7s} {'rel err':>8s}"
    ]
    for r in rows:
        head = f"{r['model']:14s} {r['op']:34s} {r.get('M', ''):>5} {r['kernel']:24s}"
        if "error" in r:
            lines.append(f"{head} ERROR {r['error'][:200]}")
            continue
        speed = r.get("speedup_vs_fp16", r.get("speedup_vs_sdpa", 1.0))
        lines.append(
            f"{head} {r['us']:9.1f} {r['GBps']:8.1f} {r['TFLOPs']:8.2f} {speed:7.2f} "
            f"{r['max_rel_err']:8.1e}"
        )
    return lines


def worst_error(rows: list[dict[str, Any]]) -> float:
    """The largest max relative error over rows; inf when a row failed."""
    if any("error" in r for r in rows):
        return math.inf
    return max((r["max_rel_err"] for r in rows), default=0.0)
