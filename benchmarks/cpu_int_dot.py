"""Integer-dot int4 matmuls vs dense matmuls, ms per SmolLM2-135M layer at several row counts,
side by side in one run, with 30 layers' weights cycled so they come from memory as in a real
step. Columns: the row layout (edgellm/kernels/csrc/cpu/qgemm.cpp, the AVX2 code), the n16 layout
(qgemm_n16.cpp: VNNI, or AVX2's vpmaddubsw without it) and on AMX tiles (qgemm_amx.cpp) where this CPU has them, the fp32 dense
matmul and, on CPUs with bf16 units, the bf16 one (oneDNN, the weight pre-reordered). Ratios are
against the row layout. Writes --out (JSON) when given; results/cpu_int_dot_*.json hold runs.

    python benchmarks/cpu_int_dot.py [--rows 1,2,4,8,16,64] [--layers 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edgellm.bench.machine import cpu_name, machine_info
from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native
from edgellm.kernels.reference import (
    int_weight_ref,
    pack_int4_blocks_ref,
    pack_int_n16_ref,
    tile_n16_ref,
)
from edgellm.quant.linear_kernels.onednn import bf16_linear, pack_bf16, packed_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
NEVER = 1 << 62


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    isa = select()
    native = cpu_native.load(isa)
    if native is None:
        raise SystemExit("the C++ CPU kernels are not available on this machine")
    amx = native.amx_ready()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        ws = []
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k))
            sc, off = (torch.rand(n, k // 32) + 0.1).half(), torch.randn(n, k // 32).half()
            w = int_weight_ref(q, sc, off, 32)
            ws.append({"rows": (pack_int4_blocks_ref(q), sc, off), "n": n,
                       "n16": (pack_int_n16_ref(q, 4), tile_n16_ref(sc), tile_n16_ref(off)),
                       "fp32": w, "bf16": pack_bf16(w, packed_available()) if isa.bf16_units else None})
        layers.append(ws)
    empty = torch.empty(0)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) / args.layers * 1e3

    def each(xs, call):
        return [call(x, w) for ws in layers for w, x in zip(ws, xs)]

    columns = ["rows", "n16"] + (["n16 amx"] if amx else []) + ["fp32"] + \
        (["bf16"] if isa.bf16_units else [])
    print(f"{cpu_name()}: isa {isa.describe()}, n16 tiles {native.n16_variant()}, {torch.get_num_threads()} threads; ms per layer "
          "(ratio: the row layout's time / this one's)")
    table = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        xb = [x.to(torch.bfloat16) for x in xs]
        calls = {
            "rows": lambda: each(xs, lambda x, w: native.int_linear(x, *w["rows"], 4, 32, empty)),
            "n16": lambda: each(xs, lambda x, w: native.int_linear_n16(x, *w["n16"], 4, 32, empty, w["n"], NEVER)),
            "n16 amx": lambda: each(xs, lambda x, w: native.int_linear_n16(x, *w["n16"], 4, 32, empty, w["n"], 0)),
            "fp32": lambda: each(xs, lambda x, w: F.linear(x, w["fp32"])),
            "bf16": lambda: each(xb, lambda x, w: bf16_linear(x, w["bf16"])),
        }
        times = {c: best(calls[c]) for c in columns}
        table[rows] = times
        cells = "  ".join(f"{c} {t:.3f} ({times['rows'] / t:.2f}x)" for c, t in times.items())
        print(f"rows {rows:4d}: {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/cpu_int_dot.py --rows " + args.rows,
            "what": "ms per SmolLM2-135M layer (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), "
                    f"{args.layers} layers' random int4 weights (g=32, fp16 scale/offset) cycled; best of 3",
            "machine": {**machine_info(), "isa": isa.describe()},
            "date": time.strftime("%Y-%m-%d"),
            "ms_per_layer": table,
        }, indent=1))


if __name__ == "__main__":
    main()
