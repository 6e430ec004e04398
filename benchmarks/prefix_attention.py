"""Cascade prefill attention over a cached shared prefix, per kernel, side by side in one run.

The shape is a voice wave of the default model (SmolLM2-135M: 9 query heads, 3 kv heads of 64):
--chunks new turns of --turn tokens each over a --prefix-token cached system prompt, one layer's
attention call (edgellm/attention/cpu.py's cascade path) with the shared prefix attended by
  - flash-fp32:  torch's CPU flash op in fp32 (CPUs without bf16 units),
  - scores-fp32: one C++ pass per query row over the prefix and the turn's own keys, in fp32 (FMA),
  - flash-bf16:  the same op in bf16,
  - scores-bf16: one C++ pass per query row over the prefix and the turn's own keys, scores and
                 values by vdpbf16ps (edgellm/kernels/csrc/cpu/cascade_attention.cpp)
                 (edgellm/attention/cpu_prefix.py; needs AVX512-BF16 to be fast),
and which of each dtype's two the load-time measurement picks here (`prefix_kernel`). Reports ms per
layer (best of --repeats) and the ratios to flash-bf16.

    python benchmarks/prefix_attention.py [--chunks 8] [--turn 46] [--prefix 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.attention.cpu_prefix import prefix_kernel
from edgellm.bench.machine import machine_info
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native

HQ, HKV, D, BS = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="new turns in the step")
    ap.add_argument("--turn", type=int, default=46, help="new tokens per turn")
    ap.add_argument("--prefix", type=int, default=512, help="cached shared prefix (multiple of 16)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "prefix_attention.json"))
    args = ap.parse_args()
    native = cpu_native.load()
    g = torch.Generator().manual_seed(0)
    shared = args.prefix // BS
    own = -(-args.turn // BS)
    nb = shared + args.chunks * own + 1
    cache = torch.randn(2, nb, BS, HKV, D, generator=g)
    tables = torch.tensor(
        [list(range(shared)) + [shared + own * i + j for j in range(own)] for i in range(args.chunks)],
        dtype=torch.int32,
    )
    seq_lens = [args.prefix + args.turn] * args.chunks
    starts = [args.turn * i for i in range(args.chunks + 1)]
    n = starts[-1]
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    variants = {
        "flash-fp32": CpuAttention(native, torch.float32, "flash"),
        "scores-fp32": CpuAttention(native, torch.float32, "scores"),
        "flash-bf16": CpuAttention(native, torch.bfloat16, "flash"),
        "scores-bf16": CpuAttention(native, torch.bfloat16, "scores"),
    }

    def best(att: CpuAttention) -> float:
        times = []
        for _ in range(args.repeats + 2):
            t0 = time.perf_counter()
            att.paged(q, k, v, cache, tables, seq_lens, starts, 0, D**-0.5, None, 1.0, 1.0, {})
            times.append(time.perf_counter() - t0)
        return min(times[2:]) * 1e3

    ms = {name: best(att) for name, att in variants.items()}
    chosen = {"bf16": prefix_kernel(native, torch.bfloat16), "fp32": prefix_kernel(native, torch.float32)}
    isa = select()
    print(f"{isa.describe()}, {torch.get_num_threads()} threads; {args.chunks} turns x {args.turn} "
          f"tokens over a {args.prefix}-token cached prefix, one layer:")
    for name, t in ms.items():
        print(f"  {name:12s} {t:7.3f} ms  ({ms['flash-bf16'] / t:.2f}x flash-bf16)")
    print(f"  the load-time measurement picks: {chosen}")
    write_json(args.out, {
        **header(__doc__, __file__),
        "machine": {**machine_info(), "isa": isa.describe()},
        "shape": {"chunks": args.chunks, "turn": args.turn, "prefix": args.prefix,
                  "q_heads": HQ, "kv_heads": HKV, "head_dim": D},
        "ms_per_layer": ms,
        "ratio_to_flash_bf16": {name: ms["flash-bf16"] / t for name, t in ms.items()},
        "chosen_prefix_kernel": chosen,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
