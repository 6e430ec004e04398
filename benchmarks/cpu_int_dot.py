"""Integer-dot int4 matmul (edgellm/kernels/csrc/cpu/qgemm.cpp) vs the fp32 dense matmul, ms per
SmolLM2-135M layer at several row counts, with 30 layers' weights cycled so they come from memory
as in a real step. Prints one line per row count (and their ratio); results/cpu_int_dot_avx2.json
holds a run on an AVX2 EPYC.

    python benchmarks/cpu_int_dot.py [--rows 1,2,4,8,16,64] [--layers 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native
from edgellm.kernels.reference import int_weight_ref, pack_int4_blocks_ref

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    isa = select()
    native = cpu_native.load(isa)
    if native is None:
        raise SystemExit("the C++ CPU kernels are not available on this machine")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        ws = []
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k))
            sc, off = (torch.rand(n, k // 32) + 0.1).half(), torch.randn(n, k // 32).half()
            ws.append((pack_int4_blocks_ref(q), sc, off, int_weight_ref(q, sc, off, 32)))
        layers.append(ws)
    empty = torch.empty(0)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) / args.layers * 1e3

    print(f"isa {isa.describe()}, {torch.get_num_threads()} threads; ms per layer")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        t_int = best(lambda: [native.int_linear(x, qw, sc, off, 4, 32, empty)
                              for ws in layers for (qw, sc, off, _), x in zip(ws, xs)])
        t_dense = best(lambda: [F.linear(x, w) for ws in layers for (_, _, _, w), x in zip(ws, xs)])
        print(f"rows {rows:4d}: int-dot {t_int:.3f}  fp32 {t_dense:.3f}  fp32/int-dot {t_dense / t_int:.2f}x")


if __name__ == "__main__":
    main()
