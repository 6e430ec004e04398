"""Times each Triton kernel against torch on a GPU and checks it is correct there.

One command for a lent GPU (see the device tool): it measures the machine's
ceilings (HBM copy bandwidth, cuBLAS fp16 TFLOP/s), then for the decode and
prefill shapes of Phi-3.5-mini and Llama-3.1-8B times
  - W4A16 dequant-GEMM (GPTQ/canonical layout, group 128) vs cuBLAS fp16 matmul,
  - W8A16 and FP8 GEMM vs cuBLAS fp16,
  - paged attention (decode over a 16-token-block cache, chunked prefill over a
    cached prefix) with fp16 and fp8 KV vs torch SDPA on contiguous K/V,
and reports achieved GB/s and TFLOP/s next to the ceilings, with the max error
of each kernel against its torch reference on the GPU.

    python benchmarks/gpu_kernels.py                 # on CUDA: full run, prints a table, writes JSON
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --dry-run   # CPU: tiny shapes, correctness only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from edgellm.kernels.dequant_gemm import w4a16_gemm, w8a16_gemm
from edgellm.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from edgellm.kernels.grouped_gemm import w8g_gemm, w8g_gemm_ref
from edgellm.kernels.int4_layouts import repack_int4, unpack_int4_weight
from edgellm.kernels.kv_cache import write_kv_triton
from edgellm.kernels.paged_attention import paged_attention_ref
from edgellm.kernels.paged_attention_triton import paged_attention_triton

# (name, hidden, intermediate, q heads, kv heads, head_dim)
MODELS = [
    ("phi-3.5-mini", 3072, 8192, 32, 32, 96),
    ("llama-3.1-8b", 4096, 14336, 32, 8, 128),
]
DRY_MODELS = [("tiny", 64, 96, 4, 2, 32)]


def bench(fn, warmup: int = 5, iters: int = 30) -> float:
    """Median seconds per call (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def ceilings(dev: torch.device) -> dict[str, float]:
    n = 1 << 28  # 512 MiB of fp16
    a = torch.empty(n, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a), 3, 10)
    x = torch.randn(8192, 8192, dtype=torch.float16, device=dev)
    tm = bench(lambda: x @ x, 3, 10)
    return {"copy_GBps": 2 * a.numel() * 2 / t / 1e9, "fp16_matmul_TFLOPs": 2 * 8192**3 / tm / 1e12}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def gemm_rows(models, ms, dev, dtype, iters) -> list[dict]:
    rows = []
    for name, hidden, inter, hq, hkv, hd in models:
        shapes = {
            "qkv": ((hq + 2 * hkv) * hd, hidden),
            "o": (hidden, hq * hd),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
        }
        for layer, (n, k) in shapes.items():
            g = 128 if k % 128 == 0 else 32
            q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
            zeros = torch.randint(4, 12, (n, k // g), device=dev, dtype=torch.int32)
            scales = (torch.rand(n, k // g, device=dev) * 0.02 + 0.005).to(dtype)
            w4 = repack_int4(q, zeros, scales, g)
            w_ref = unpack_int4_weight(w4).to(dtype)
            w8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
            s8 = (torch.rand(n, 1, device=dev) * 0.01 + 1e-3).to(dtype)
            w_fp8 = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
            s_fp8 = (torch.rand(n, 1, device=dev) * 0.01 + 1e-3).float()
            # GGUF's kept-quantized forms: Q4_K (int4, groups of 32 with offsets), Q6_K (int8 codes, 16)
            off = torch.randn(n, k // 32, device=dev) * 0.01
            wk = repack_int4(q, None, (torch.rand(n, k // 32, device=dev) * 0.02).float(), 32, offsets=off)
            wk_ref = unpack_int4_weight(wk).to(dtype)
            c6 = torch.randint(-32, 32, (n, k), device=dev, dtype=torch.int8)
            s6 = torch.rand(k // 16, n, device=dev) * 0.01
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x @ w_ref.t()
                err4 = rel_err(w4a16_gemm(x, **vars(w4)), ref)
                err8 = rel_err(w8a16_gemm(x, w8, s8), x @ (w8.to(dtype) * s8).t())
                errf = rel_err(fp8_gemm(x, w_fp8, s_fp8), fp8_gemm_ref(x, w_fp8, s_fp8))
                t_ref = bench(lambda: x @ w_ref.t(), iters=iters)
                t4 = bench(lambda: w4a16_gemm(x, **vars(w4)), iters=iters)
                t8 = bench(lambda: w8a16_gemm(x, w8, s8), iters=iters)
                tf = bench(lambda: fp8_gemm(x, w_fp8, s_fp8), iters=iters)
                errk = rel_err(w4a16_gemm(x, **vars(wk)), x @ wk_ref.t())
                err6 = rel_err(w8g_gemm(x, c6, s6, 16), w8g_gemm_ref(x, c6, s6, 16))
                tk = bench(lambda: w4a16_gemm(x, **vars(wk)), iters=iters)
                t6 = bench(lambda: w8g_gemm(x, c6, s6, 16), iters=iters)
                flops = 2 * m * n * k
                for kind, t, wbytes, err in (("fp16 cuBLAS", t_ref, n * k * 2, 0.0),
                                             ("w4a16", t4, n * k // 2 + scales.numel() * 2, err4),
                                             ("w8a16", t8, n * k, err8), ("fp8", tf, n * k, errf),
                                             ("q4_k w4 offsets", tk, n * k // 2 + n * k // 32 * 8, errk),
                                             ("q6_k w8 grouped", t6, n * k + n * k // 16 * 4, err6)):
                    rows.append({"model": name, "op": f"gemm {layer}", "M": m, "N": n, "K": k, "kernel": kind,
                                 "us": t * 1e6, "GBps": (wbytes + m * k * 2 + m * n * 2) / t / 1e9,
                                 "TFLOPs": flops / t / 1e12, "speedup_vs_fp16": t_ref / t,
                                 "max_rel_err": err})
    return rows


def _paged_case(batch, ctx, q_len, hq, hkv, hd, dev, dtype, kv_dtype, block=16):
    g = torch.Generator(device="cpu").manual_seed(0)
    nblk = batch * (-(-ctx // block)) + 4
    cache = torch.zeros(2, nblk, block, hkv, hd, device=dev, dtype=kv_dtype)
    perm = torch.randperm(nblk, generator=g).to(dev)
    per_seq = -(-ctx // block)
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    k_all = torch.randn(batch, ctx, hkv, hd, device=dev, dtype=dtype)
    v_all = torch.randn(batch, ctx, hkv, hd, device=dev, dtype=dtype)
    k_scale = v_scale = 1.0
    if kv_dtype == torch.float8_e4m3fn:
        k_scale = float(k_all.abs().max()) / 448
        v_scale = float(v_all.abs().max()) / 448
    slots = (tables.long()[:, :, None] * block + torch.arange(block, device=dev)).view(batch, -1)[:, :ctx]
    write_kv_triton(k_all.reshape(-1, hkv, hd), v_all.reshape(-1, hkv, hd), cache,
                    slots.reshape(-1), k_scale, v_scale)
    q = torch.randn(batch * q_len, hq, hd, device=dev, dtype=dtype)
    k_new = k_all[:, ctx - q_len:].reshape(-1, hkv, hd)
    v_new = v_all[:, ctx - q_len:].reshape(-1, hkv, hd)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    num_decodes = batch if q_len == 1 else 0
    return q, k_new, v_new, cache, tables, seq_lens, qsl, num_decodes, k_all, v_all, k_scale, v_scale


def attention_rows(models, cases, dev, dtype, iters) -> list[dict]:
    rows = []
    for name, _, _, hq, hkv, hd in models:
        scale = hd**-0.5
        for batch, ctx, q_len in cases:
            for kv_dtype in (dtype, torch.float8_e4m3fn):
                (q, k_new, v_new, cache, tables, seq_lens, qsl, nd, k_all, v_all,
                 ks, vs) = _paged_case(batch, ctx, q_len, hq, hkv, hd, dev, dtype, kv_dtype)
                args = (q, k_new, v_new, cache, tables, seq_lens, qsl, nd, scale)
                got = paged_attention_triton(*args, k_scale=ks, v_scale=vs, max_query_len=q_len, max_seq_len=ctx)
                want = paged_attention_ref(q, k_new, v_new, cache, tables, seq_lens.tolist(), qsl.tolist(), nd,
                                           scale, None, ks, vs)
                err = rel_err(got, want)
                t = bench(lambda: paged_attention_triton(*args, k_scale=ks, v_scale=vs, max_query_len=q_len,
                                                         max_seq_len=ctx), iters=iters)
                # baseline: SDPA over contiguous K/V of the same shapes
                qb = q.view(batch, q_len, hq, hd).transpose(1, 2)
                kb, vb = k_all.transpose(1, 2), v_all.transpose(1, 2)
                causal = q_len > 1

                def sdpa():
                    if q_len == ctx:
                        return torch.nn.functional.scaled_dot_product_attention(
                            qb, kb, vb, is_causal=causal, enable_gqa=True)
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

                t_ref = bench(sdpa, iters=iters)
                kv_bytes = 2 * batch * ctx * hkv * hd * cache.element_size()
                flops = 4 * batch * q_len * ctx * hq * hd
                rows.append({"model": name, "op": f"attention B={batch} ctx={ctx} q={q_len}",
                             "kernel": f"paged ({str(kv_dtype).replace('torch.', '')} KV)", "us": t * 1e6,
                             "GBps": kv_bytes / t / 1e9, "TFLOPs": flops / t / 1e12,
                             "speedup_vs_sdpa": t_ref / t, "sdpa_us": t_ref * 1e6, "max_rel_err": err})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the interpreter")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_kernels.json"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run (interpreter, tiny shapes) or on a lent GPU")
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    models = MODELS if cuda else DRY_MODELS
    ms = [1, 16, 512, 2048] if cuda else [1, 5]
    cases = [(16, 2048, 1), (1, 2048, 512), (1, 1024, 1024)] if cuda else [(2, 37, 1), (1, 40, 9)]
    iters = 30 if cuda else 1
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter dry run)",
                    "torch": torch.__version__}
    if cuda:
        report["ceilings"] = ceilings(dev)
        print(f"ceilings: {report['ceilings']}")
    report["gemm"] = gemm_rows(models, ms, dev, dtype, iters)
    report["attention"] = attention_rows(models, cases, dev, dtype, iters)
    worst = 0.0
    print(f"{'model':14s} {'op':34s} {'M':>5s} {'kernel':22s} {'us':>9s} {'GB/s':>8s} {'TFLOP/s':>8s} "
          f"{'x base':>7s} {'rel err':>8s}")
    for r in report["gemm"] + report["attention"]:
        speed = r.get("speedup_vs_fp16", r.get("speedup_vs_sdpa", 1.0))
        print(f"{r['model']:14s} {r['op']:34s} {r.get('M', ''):>5} {r['kernel']:22s} {r['us']:9.1f} "
              f"{r['GBps']:8.1f} {r['TFLOPs']:8.2f} {speed:7.2f} {r['max_rel_err']:8.1e}")
        worst = max(worst, r["max_rel_err"])
    ok = worst < 3e-2
    print(f"correctness: worst max relative error {worst:.2e} -> {'OK' if ok else 'FAIL'}")
    if cuda:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
