"""Paged attention and the KV write on a GPU, timed and checked against their torch references:
`paged_case` (a random paged cache of B sequences of `ctx` tokens, 16-token blocks in shuffled
order, filled by the Triton KV write), `attention_rows` (decode and chunked prefill over it,
fp16 and fp8 KV, against SDPA on contiguous K/V) and `kv_write_rows` (the write alone). Rows
have the columns of `gpu_kernels.table`; a case that fails gives a row with its error."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from edgellm.bench.gpu_kernels import Shape, bench, measured, rel_err

FP8 = torch.float8_e4m3fn


def paged_case(
    batch: int,
    ctx: int,
    q_len: int,
    hq: int,
    hkv: int,
    hd: int,
    dev: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block: int = 16,
) -> dict[str, Any]:
    """Random K/V of `batch` sequences of `ctx` tokens written into a paged cache, and the
    queries of their last `q_len` tokens: the paged kernel's arguments and the contiguous K/V."""
    from edgellm.kernels.kv_cache import write_kv_triton

    g = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-ctx // block)
    nblk = batch * per_seq + 4
    cache = torch.zeros(2, nblk, block, hkv, hd, device=dev, dtype=kv_dtype)
    perm = torch.randperm(nblk, generator=g).to(dev)
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    k_all = torch.randn(batch, ctx, hkv, hd, device=dev, dtype=dtype)
    v_all = torch.randn(batch, ctx, hkv, hd, device=dev, dtype=dtype)
    k_scale = v_scale = 1.0
    if kv_dtype == FP8:
        k_scale = float(k_all.abs().max()) / 448
        v_scale = float(v_all.abs().max()) / 448
    offsets = torch.arange(block, device=dev)
    slots = (tables.long()[:, :, None] * block + offsets).view(batch, -1)[:, :ctx]
    write_kv_triton(
        k_all.reshape(-1, hkv, hd),
        v_all.reshape(-1, hkv, hd),
        cache,
        slots.reshape(-1),
        k_scale,
        v_scale,
    )
    return {
        "q": torch.randn(batch * q_len, hq, hd, device=dev, dtype=dtype),
        "k_new": k_all[:, ctx - q_len :].reshape(-1, hkv, hd),
        "v_new": v_all[:, ctx - q_len :].reshape(-1, hkv, hd),
        "cache": cache,
        "tables": tables,
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        "qsl": torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev),
        "num_decodes": batch if q_len == 1 else 0,
        "k_all": k_all,
        "v_all": v_all,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }


def _attention(c: dict[str, Any], hd: int, q_len: int, ctx: int, iters: int) -> tuple:
    """(kernel seconds, max error, SDPA seconds) of one case."""
    from edgellm.kernels.paged_attention import paged_attention_ref
    from edgellm.kernels.paged_attention_triton import paged_attention_triton

    scale = hd**-0.5
    args = (c["q"], c["k_new"], c["v_new"], c["cache"], c["tables"], c["seq_lens"], c["qsl"])
    kw = {"k_scale": c["k_scale"], "v_scale": c["v_scale"], "max_query_len": q_len}

    def run() -> torch.Tensor:
        return paged_attention_triton(*args, c["num_decodes"], scale, **kw, max_seq_len=ctx)

    want = paged_attention_ref(
        *args[:5],
        c["seq_lens"].tolist(),
        c["qsl"].tolist(),
        c["num_decodes"],
        scale,
        None,
        c["k_scale"],
        c["v_scale"],
    )
    err = rel_err(run(), want)
    t = bench(run, iters=iters)
    batch = c["seq_lens"].numel()
    hq = c["q"].shape[1]
    qb = c["q"].view(batch, q_len, hq, hd).transpose(1, 2)
    kb, vb = c["k_all"].transpose(1, 2), c["v_all"].transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def baseline() -> torch.Tensor:  # SDPA over contiguous K/V of the same shapes
        return sdpa(qb, kb, vb, is_causal=q_len == ctx and q_len > 1, enable_gqa=True)

    return t, err, bench(baseline, iters=iters)


def attention_rows(
    models: list[Shape],
    cases: list[tuple[int, int, int]],
    dev: torch.device,
    dtype: torch.dtype,
    iters: int,
    deadline: float = math.inf,
) -> list[dict[str, Any]]:
    """Per case (batch, ctx, q_len), model and KV dtype: the paged kernel's time, KV GB/s,
    TFLOP/s, speedup over SDPA and max error against the torch reference."""
    rows: list[dict[str, Any]] = []
    for batch, ctx, q_len in cases:
        for name, _, _, hq, hkv, hd in models:
            for kv_dtype in (dtype, FP8):
                if time.monotonic() > deadline:
                    return rows
                kv = str(kv_dtype).replace("torch.", "")
                base = {
                    "model": name,
                    "op": f"attention B={batch} ctx={ctx} q={q_len}",
                    "kernel": f"paged ({kv} KV)",
                    "batch": batch,
                    "ctx": ctx,
                    "q_len": q_len,
                    "kv_dtype": kv,
                }
                out: dict[str, float] = {}

                def run(b=batch, n=ctx, q=q_len, h=(hq, hkv, hd), kd=kv_dtype, out=out) -> tuple:
                    case = paged_case(b, n, q, *h, dev, dtype, kd)
                    t, err, out["sdpa_s"] = _attention(case, h[2], q, n, iters)
                    out["kv_bytes"] = 2 * b * n * h[1] * h[2] * case["cache"].element_size()
                    return t, err

                row = measured(base, run)
                t = row["us"] / 1e6
                row["GBps"] = out.get("kv_bytes", math.nan) / t / 1e9
                row["TFLOPs"] = 4 * batch * q_len * ctx * hq * hd / t / 1e12
                row["sdpa_us"] = out.get("sdpa_s", math.nan) * 1e6
                row["speedup_vs_sdpa"] = row["sdpa_us"] / row["us"]
                rows.append(row)
    return rows


def kv_write_rows(
    models: list[Shape],
    token_counts: list[int],
    dev: torch.device,
    dtype: torch.dtype,
    iters: int,
) -> list[dict[str, Any]]:
    """The Triton KV write of T tokens (into shuffled slots) per model and KV dtype: time,
    GB/s (bytes read + written) and max error against the torch write (bit-equal expected)."""
    from edgellm.kernels.kv_cache import write_kv_triton
    from edgellm.kernels.paged_attention import write_kv_ref

    rows: list[dict[str, Any]] = []
    for name, _, _, _, hkv, hd in models:
        for tokens in token_counts:
            for kv_dtype in (dtype, FP8):
                kv = str(kv_dtype).replace("torch.", "")
                base = {"model": name, "op": f"kv write T={tokens}", "kernel": f"{kv} KV"}
                nblk = -(-tokens // 16) + 8
                out: dict[str, int] = {}

                def run(t=tokens, nb=nblk, kd=kv_dtype, h=(hkv, hd), out=out) -> tuple:
                    key = torch.randn(t, *h, device=dev, dtype=dtype)
                    value = torch.randn(t, *h, device=dev, dtype=dtype)
                    slots = torch.randperm(nb * 16, device=dev)[:t]
                    ks = float(key.abs().max()) / 448 if kd == FP8 else 1.0
                    vs = float(value.abs().max()) / 448 if kd == FP8 else 1.0
                    got = torch.zeros(2, nb, 16, *h, device=dev, dtype=kd)
                    want = torch.zeros_like(got)
                    write_kv_triton(key, value, got, slots, ks, vs)
                    write_kv_ref(key, value, want, slots, ks, vs)
                    err = rel_err(got.float(), want.float())
                    out["bytes"] = 2 * key.numel() * (key.element_size() + got.element_size())
                    return bench(
                        lambda: write_kv_triton(key, value, got, slots, ks, vs), iters=iters
                    ), err

                row = measured(base, run)
                row["GBps"] = out.get("bytes", math.nan) / (row["us"] / 1e6) / 1e9
                row["TFLOPs"] = 0.0
                rows.append(row)
    return rows
