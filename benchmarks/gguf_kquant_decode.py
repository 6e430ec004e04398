"""GGUF types on the CPU integer-dot kernel: ms per decoder layer of Qwen3-0.6B's shapes (qkv,
o, gate_up, down) for each type as edgellm keeps it (quant/gguf_blocks.py), side by side in one
run, with 28 layers' weights cycled so they come from memory as in a real step; the ratio to
Q4_0 is what matters (the issue's target: K-quants within 10% of Q4_0). "Q4_K_M mix" is the
layer llama-quantize's Q4_K_M makes every few layers: q/k/o/gate/up Q4_K, v and down Q6_K (the
fused qkv then runs as int8 codes). The int8-code types are stored in 5 or 6 bits where their
codes fit (CpuIntDotKernel.bits), and the K-quants' scales and minimums in the compact form
(int8 multipliers of an fp32 base per 256 columns, cpu_int_storage.compact_scales). Side by side,
"(fp32 scales)" rows run the same codes with fp32 scales and offsets, "Q4_0 (offsets)" Q4_0 as
codes 0..15 with offsets -8 x scale (its storage before the symmetric zero), and with --widened
"(8-bit)" rows the same codes stored in 8 bits. Writes benchmarks/results/gguf_kquant_decode.json.

    python benchmarks/gguf_kquant_decode.py [--rows 1,4,16] [--layers 28] [--rounds 5] [--widened]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edgellm.bench.gguf_rows import random_rows
from edgellm.bench.machine import machine_info
from edgellm.kernels.reference import pack_int_n16_ref, unpack_int_n16_ref
from edgellm.platform import Platform
from edgellm.quant import gguf_blocks
from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
# per module: one type, or per-shard types with their row counts (q 2048, k 1024, v 1024)
LAYERS = {
    "Q4_0": dict.fromkeys(SHAPES, "Q4_0"),
    "Q4_K": dict.fromkeys(SHAPES, "Q4_K"),
    "Q5_K": dict.fromkeys(SHAPES, "Q5_K"),
    "Q6_K": dict.fromkeys(SHAPES, "Q6_K"),
    "Q8_0": dict.fromkeys(SHAPES, "Q8_0"),
    "Q4_K_M mix": {
        "qkv": [("Q4_K", 3072), ("Q6_K", 1024)],
        "o": "Q4_K",
        "gate_up": "Q4_K",
        "down": "Q6_K",
    },
    "Q5_0": dict.fromkeys(SHAPES, "Q5_0"),
}
WIDENED = ("Q5_0", "Q5_K", "Q6_K", "Q4_K_M mix")  # --widened: also with their codes in 8 bits
COMPACT = ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M mix")  # also timed with fp32 scales and offsets


def kernel(
    types,
    n: int,
    k: int,
    native,
    platform,
    wide: bool = False,
    fp32_scales: bool = False,
    offsets: bool = False,
) -> CpuIntDotKernel:
    shards = [(types, n)] if isinstance(types, str) else types
    raws = [(t, random_rows(t, rows, k, seed=rows)) for t, rows in shards]
    if all(t in gguf_blocks.INT4_TYPES for t, _ in raws) and len({t for t, _ in raws}) == 1:
        codes = gguf_blocks.int4_codes(raws[0][1], raws[0][0])
    else:
        group = min(gguf_blocks.group_of(t) for t, _ in raws)
        codes = gguf_blocks.concat_int8([gguf_blocks.int8_codes(r, t, group) for t, r in raws])
    if fp32_scales:
        codes.scale_split = codes.offset_split = None
    if offsets:  # symmetric int4 as W = scale * q + (-8 scale): the offsets path, zero 0
        codes.offsets = torch.zeros_like(codes.scales)
    kern = CpuIntDotKernel(codes, native, platform)
    if wide and kern.bits in (5, 6):  # the same codes in 8 bits
        codes = unpack_int_n16_ref(kern.qweight, kern.n, kern.bits, kern.zero)
        kern.qweight, kern.bits, kern.zero = pack_int_n16_ref(codes, 8), 8, 128
    return kern


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, best of each kept")
    ap.add_argument(
        "--widened", action="store_true", help="also time 5/6-bit codes stored in 8 bits"
    )
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "gguf_kquant_decode.json")
    )
    args = ap.parse_args()
    platform = Platform(
        cpu_quant="auto", dense_budget=0
    )  # integer dots only: this measures the kernel
    native = platform.native()
    if native is None:
        raise SystemExit("the C++ CPU kernels are not available on this machine")
    built = {
        name: [
            {m: kernel(t, *SHAPES[m], native, platform) for m, t in spec.items()}
            for _ in range(args.layers)
        ]
        for name, spec in LAYERS.items()
    }
    for name in COMPACT:
        built[f"{name} (fp32 scales)"] = [
            {
                m: kernel(t, *SHAPES[m], native, platform, fp32_scales=True)
                for m, t in LAYERS[name].items()
            }
            for _ in range(args.layers)
        ]
    built["Q4_0 (offsets)"] = [
        {m: kernel("Q4_0", *SHAPES[m], native, platform, offsets=True) for m in SHAPES}
        for _ in range(args.layers)
    ]
    for name in WIDENED if args.widened else ():
        built[f"{name} (8-bit)"] = [
            {m: kernel(t, *SHAPES[m], native, platform, wide=True) for m, t in LAYERS[name].items()}
            for _ in range(args.layers)
        ]
    result_bits = {
        name: sorted({k.bits for k in layers[0].values()}) for name, layers in built.items()
    }
    scale_bytes = {
        name: sum(k.scale.nbytes + k.offset.nbytes for k in layers[0].values())
        for name, layers in built.items()
    }
    result: dict = {
        "machine": machine_info(),
        "isa": platform.isa.describe(),
        "shapes": "Qwen3-0.6B",
        "stored_bits": result_bits,
        "scale_bytes_per_layer": scale_bytes,
        "ms_per_layer": {},
        "vs_Q4_0": {},
        "compact_vs_fp32_scales": {},
        "Q4_0_symmetric_vs_offsets": {},
    }
    if args.widened:
        result["narrow_vs_8bit"] = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {m: torch.randn(rows, k) for m, (_, k) in SHAPES.items()}
        times = {name: float("inf") for name in built}
        for _ in range(args.rounds):  # interleaved rounds: the types see the same machine noise
            for name, layers in built.items():
                t0 = time.perf_counter()
                for layer in layers:
                    for m, kern in layer.items():
                        kern.int_dot(xs[m], None)
                times[name] = min(times[name], (time.perf_counter() - t0) / args.layers * 1e3)
        result["ms_per_layer"][rows] = {n: round(t, 4) for n, t in times.items()}
        result["vs_Q4_0"][rows] = {n: round(t / times["Q4_0"], 3) for n, t in times.items()}
        result["compact_vs_fp32_scales"][rows] = {
            n: round(times[f"{n} (fp32 scales)"] / times[n], 3) for n in COMPACT
        }
        sym = times["Q4_0 (offsets)"] / times["Q4_0"]
        result["Q4_0_symmetric_vs_offsets"][rows] = round(sym, 3)
        if args.widened:
            result["narrow_vs_8bit"][rows] = {
                n: round(times[f"{n} (8-bit)"] / times[n], 3) for n in WIDENED
            }
        print(
            f"rows {rows:3d}: "
            + "  ".join(f"{n} {t:.3f} ms ({t / times['Q4_0']:.2f}x)" for n, t in times.items())
        )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
