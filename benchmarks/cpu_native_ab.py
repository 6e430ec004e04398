"""The C++ CPU kernels of this tree against those of another commit, in one process: both
modules are built (each named by its sources, so both load side by side) and every op is timed
on the same inputs, base and this tree alternating, best of --repeats each. On machines whose
speed moves by 20% from minute to minute, runs in separate processes cannot show a 10% change;
this can.

Ops: int_linear_n16 over a SmolLM2-135M layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; int4, groups of 32, fp16 scales and offsets, or with --linear g16-8 / g16-6 Q6_K-like
int8 codes -32..31 in groups of 16 with fp32 scales, stored in 8 or 6 bits; 8 layers' weights cycled) at each of
--rows, and prefill_attention (fp32, causal, 9 query and 3 kv heads of 64 dims, pages of 16) at
each of --tokens, and with --head VxK the int8 logits head's product (int_linear_n16, bits 8, one
scale per vocabulary row: IntDotLogitsHead's codes) at each of --head-rows, and with --decode
BxCTX,... decode attention over 30 layers' fp16 pages (heads --decode-heads). Ratios are the
base's time over this tree's (> 1: this tree is faster).

    python benchmarks/cpu_native_ab.py --base 0c5d4bb [--rows 1,8,16,64,128,256]
        [--tokens 128,550,1024] [--head 262144x640 --head-rows 1,16]
        [--decode 1x300,1x1024,16x512 --decode-heads 9x3x64] [--out FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from edgellm.bench.machine import describe, machine_info
from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native
from edgellm.kernels.reference import pack_int_n16_ref, tile_n16_ref

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
CSRC = "edgellm/kernels/csrc/cpu"
NEVER = 1 << 62


def build_at(commit: str, into: Path):
    """The C++ module of `commit`'s kernel sources, built for this CPU's level."""
    repo = Path(__file__).resolve().parent.parent
    blob = subprocess.run(["git", "archive", commit, CSRC], cwd=repo, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    isa = select()
    module, why = cpu_native._build(into / CSRC, [*isa.compile_flags(), *cpu_native.OPENMP])
    if module is None:
        raise SystemExit(f"the C++ kernels of {commit} did not build: {why}")
    return module


def side_by_side(mods: dict, call, repeats: int) -> dict[str, float]:
    """Best time in ms of call(module) per module, the modules alternating."""
    times: dict[str, list[float]] = {name: [] for name in mods}
    for _ in range(repeats):
        for name, mod in mods.items():
            t0 = time.perf_counter()
            call(mod)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def head_ab(mods: dict, shape: str, rows: str, repeats: int) -> dict:
    """The int8 head [V, K] (codes + 128 in the n16 layout, one fp32 scale per row) at each row
    count, both modules alternating."""
    vocab, k = (int(v) for v in shape.lower().split("x"))
    codes = pack_int_n16_ref(torch.randint(-127, 128, (vocab, k), dtype=torch.int8), 8)
    scale = tile_n16_ref(torch.rand(vocab, 1) * 0.01)
    empty, out = torch.empty(0), {}
    for m in [int(r) for r in rows.split(",")]:
        x = torch.randn(m, k)
        t = side_by_side(mods, lambda mod, x=x: mod.int_linear_n16(x, codes, scale, empty, 8, k, empty, vocab,
                                                                   NEVER), repeats)
        out[m] = {**t, "ratio": t["base"] / t["this"], "this_gmac_s": m * vocab * k / t["this"] / 1e6}
        print(f"int8 head {vocab}x{k}, {m:4d} rows: base {t['base']:.3f}  this {t['this']:.3f}  "
              f"{t['base'] / t['this']:.2f}x  ({out[m]['this_gmac_s']:.0f} GMAC/s)")
    return out


def decode_ab(mods: dict, spec: str, heads: str, repeats: int, layers: int = 30) -> dict:
    """decode_attention over `layers` layers' own fp16 pages (so they come from memory, as in a
    step) for each BxCTX of spec (sequences x context tokens), heads HQxHKVxD, both alternating."""
    hq, hkv, d = (int(v) for v in heads.lower().split("x"))
    out = {}
    for item in spec.split(","):
        b, ctx = (int(v) for v in item.lower().split("x"))
        blocks = -(-ctx // 16)
        caches = [torch.randn(2, b * blocks + 4, 16, hkv, d).half() for _ in range(layers)]
        tables = torch.randperm(b * blocks + 4)[: b * blocks].view(b, blocks).contiguous()
        lens, q = torch.full((b,), ctx, dtype=torch.long), torch.randn(b, hq, d)

        def step(mod, caches=caches, tables=tables, lens=lens, q=q):
            for c in caches:
                mod.decode_attention(q, c, tables, lens, d**-0.5, 0)

        t = side_by_side(mods, step, repeats)
        out[item] = {**t, "ratio": t["base"] / t["this"]}
        print(f"decode_attention {heads}, {b} x {ctx} tokens, {layers} layers: base {t['base']:.3f}  "
              f"this {t['this']:.3f}  {t['base'] / t['this']:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--rows", default="1,8,16,64,128,256")
    ap.add_argument("--tokens", default="128,550,1024")
    ap.add_argument("--head", default="", help="VxK: also time an int8 logits head of that shape")
    ap.add_argument("--head-rows", default="1,16")
    ap.add_argument("--decode", default="", help="BxCTX,...: also time decode attention (fp16 pages)")
    ap.add_argument("--decode-heads", default="9x3x64", help="HQxHKVxD of --decode")
    ap.add_argument("--linear", choices=["int4", "g16-8", "g16-6"], default="int4", help="int_linear_n16's weights")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mods = {"base": build_at(args.base, Path(tmp)), "this": cpu_native.load()}
    if mods["this"] is None:
        raise SystemExit("the C++ CPU kernels of this tree are not available on this machine")
    print(f"{describe(machine_info())}; base {args.base}; ms, best of {args.repeats}, alternating")
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        ws = []
        for n, k in SHAPES:
            if args.linear == "int4":
                q = torch.randint(0, 16, (n, k))
                sc, off = (torch.rand(n, k // 32) + 0.1).half(), torch.randn(n, k // 32).half()
                ws.append((pack_int_n16_ref(q, 4), tile_n16_ref(sc), tile_n16_ref(off), n, k))
            else:
                q = torch.randint(-32, 32, (n, k))
                bits = int(args.linear.split("-")[1])
                ws.append((pack_int_n16_ref(q, bits), tile_n16_ref(torch.rand(n, k // 16) + 0.1), torch.empty(0), n, k))
        layers.append(ws)
    bits, group = {"int4": (4, 32), "g16-8": (8, 16), "g16-6": (6, 16)}[args.linear]
    empty = torch.empty(0)
    table: dict[str, dict] = {"int_linear_n16 ms per layer": {}, "prefill_attention ms per layer": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}

        def linear(mod, xs=xs):
            for ws in layers:
                for q, s, o, n, k in ws:
                    mod.int_linear_n16(xs[k], q, s, o, bits, group, empty, n, NEVER)

        t = {name: ms / len(layers) for name, ms in side_by_side(mods, linear, args.repeats).items()}
        table["int_linear_n16 ms per layer"][rows] = {**t, "ratio": t["base"] / t["this"]}
        print(f"int_linear_n16 {args.linear}, {rows:4d} rows: base {t['base']:.3f}  this {t['this']:.3f}  "
              f"{t['base'] / t['this']:.2f}x")
    for tokens in [int(x) for x in args.tokens.split(",")]:
        pages = -(-tokens // 16)
        cache = torch.randn(2, pages + 4, 16, 3, 64)
        table_ = torch.randperm(pages + 4)[:pages].long()
        q = torch.randn(tokens, 9, 64)
        t = side_by_side(mods, lambda mod: mod.prefill_attention(q, cache, table_, tokens, 0, 0.125), args.repeats)
        table["prefill_attention ms per layer"][tokens] = {**t, "ratio": t["base"] / t["this"]}
        print(f"prefill_attention, {tokens:4d} tokens: base {t['base']:.3f}  this {t['this']:.3f}  "
              f"{t['base'] / t['this']:.2f}x")
    if args.head:
        table["int8 head ms"] = head_ab(mods, args.head, args.head_rows, args.repeats)
    if args.decode:
        table[f"decode_attention {args.decode_heads} ms per step"] = decode_ab(mods, args.decode, args.decode_heads,
                                                                              args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": f"python benchmarks/cpu_native_ab.py --base {args.base} --linear {args.linear} --rows {args.rows} "
                       f"--tokens {args.tokens}" + (f" --head {args.head} --head-rows {args.head_rows}"
                                                    if args.head else "")
                       + (f" --decode {args.decode} --decode-heads {args.decode_heads}" if args.decode else ""),
            "what": "the C++ kernels of this tree against the base commit's, both loaded in one process, "
                    f"alternating, best of {args.repeats}; ratio = base time / this tree's time",
            "machine": {**machine_info(), "isa": select().describe()},
            "date": time.strftime("%Y-%m-%d"),
            "base": args.base,
            **table,
        }, indent=1))


if __name__ == "__main__":
    main()
