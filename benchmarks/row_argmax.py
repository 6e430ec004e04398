"""row_argmax (edgellm/argmax.py) against torch.argmax, side by side in one process, on the
logits a decode step samples from: [rows, vocab] fp32 for the vocabularies of SmolLM2 (49152),
Qwen2.5 / Qwen3 (151936) and Gemma 3 (262144). Ratios are torch's time over row_argmax's.

    python benchmarks/row_argmax.py [--rows 1,16] [--vocab 49152,151936,262144] [--repeats 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from edgellm.argmax import row_argmax
from edgellm.bench.machine import machine_info
from edgellm.bench.results import RESULTS, header, write_json


def best_ms(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--vocab", default="49152,151936,262144")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS / "row_argmax.json"))
    args = ap.parse_args()
    results = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
            assert torch.equal(row_argmax(x), torch.argmax(x, -1))
            torch_ms = ours_ms = float("inf")
            for _ in range(3):  # alternating, best of each
                torch_ms = min(torch_ms, best_ms(lambda t: torch.argmax(t, -1), x, args.repeats))
                ours_ms = min(ours_ms, best_ms(row_argmax, x, args.repeats))
            row = {
                "rows": rows,
                "vocab": vocab,
                "torch_argmax_ms": torch_ms,
                "row_argmax_ms": ours_ms,
                "ratio": torch_ms / ours_ms,
            }
            results.append(row)
            print(
                f"rows {rows:3d} vocab {vocab:6d}: torch.argmax {torch_ms:7.3f} ms  row_argmax "
                f"{ours_ms:7.3f} ms  {torch_ms / ours_ms:5.2f}x"
            )
    write_json(
        args.out, {**header(__doc__, __file__), "machine": machine_info(), "results": results}
    )


if __name__ == "__main__":
    main()
