"""Times each Triton kernel against torch on a GPU and checks it is correct there.

One command for a lent GPU (see the device tool): it measures the machine's
ceilings (HBM copy bandwidth, cuBLAS fp16 TFLOP/s), then for the decode and
prefill shapes of Phi-3.5-mini, Llama-3.1-8B and Qwen3-4B times
  - W4A16 dequant-GEMM (GPTQ/canonical layout, group 128) vs cuBLAS fp16 matmul,
  - W8A16 and FP8 GEMM vs cuBLAS fp16,
  - paged attention (decode over a 16-token-block cache, chunked prefill over a
    cached prefix) with fp16 and fp8 KV vs torch SDPA on contiguous K/V,
and the KV write, and reports achieved GB/s and TFLOP/s next to the ceilings, with the max error
of each kernel against its torch reference on the GPU.

    python benchmarks/gpu_kernels.py                 # on CUDA: full run, prints a table, writes JSON
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --dry-run   # CPU: tiny shapes, correctness only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from edgellm.bench.gpu_attention import attention_rows, kv_write_rows
from edgellm.bench.gpu_kernels import DRY_MODELS, MODELS, ceilings, gemm_rows, table, worst_error


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
    cases = [(16, 2048, 1), (8, 8192, 1), (1, 2048, 512), (1, 1024, 1024)] if cuda else [(2, 37, 1), (1, 40, 9)]
    iters = 30 if cuda else 1
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter dry run)",
                    "torch": torch.__version__}
    if cuda:
        report["ceilings"] = ceilings(dev)
        print(f"ceilings: {report['ceilings']}")
    report["gemm"] = gemm_rows(models, ms, dev, dtype, iters)
    report["attention"] = attention_rows(models, cases, dev, dtype, iters)
    report["kv_write"] = kv_write_rows(models, [64, 2048] if cuda else [7], dev, dtype, iters)
    rows = report["gemm"] + report["attention"] + report["kv_write"]
    print("\n".join(table(rows)))
    worst = worst_error(rows)
    ok = worst < 3e-2
    print(f"correctness: worst max relative error {worst:.2e} -> {'OK' if ok else 'FAIL'}")
    if cuda:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
