"""How many tokens of context the KV cache holds: one pool over every layer, or the split.

The split: the sliding-window layers' own pool (edgellm/engine/kv_layout.py), by cache budget and
max_num_seqs.

    python benchmarks/kv_capacity.py                                # Gemma 3 270M Q4_K_M
    python benchmarks/kv_capacity.py --model <gguf or HF dir> --budget-mib 256,1024 --seqs 1,16

The model is loaded once; each row is the layout the engine would plan for that budget and
max_num_seqs (block size 16, max_num_batched_tokens 2048). Prints a table and writes
benchmarks/results/kv_capacity.json. No asserts: tests/engine/test_kv_layout.py checks that a
context one pool cannot hold decodes exactly in the split.
"""

from __future__ import annotations

import argparse

import torch

from edgellm.bench.machine import machine_info
from edgellm.bench.models import gemma3_270m_path
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.kv_layout import plan_kv_cache, separate_window
from edgellm.engine.runner import kv_cache_bytes_per_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: Gemma 3 270M Q4_K_M (a dev extra)")
    ap.add_argument("--budget-mib", default="256,1024,4096")
    ap.add_argument("--seqs", default="1,8,16,64")
    ap.add_argument("--out", default=str(RESULTS / "kv_capacity.json"))
    args = ap.parse_args()
    model_arg = args.model or str(gemma3_270m_path())
    engine = LLMEngine(EngineConfig(model=model_arg, kv_cache_memory=16 << 20, max_num_seqs=1))
    model, cpu = engine.model, torch.device("cpu")
    split = separate_window(model)
    if split is None:
        raise SystemExit(f"{model_arg}: no mix of sliding-window and global layers; one pool only")
    window, sliding = split
    max_len = model.config.max_position_embeddings
    per_all = kv_cache_bytes_per_block(model, 16, engine.kv_dtype)
    rows = []
    print(f"{model_arg}: {model.config.num_layers} layers, {sliding} sliding (window {window})")
    print(f"{'budget MiB':>10} {'seqs':>5} {'one pool tokens':>16} {'split tokens':>13} "
          f"{'window blocks':>14} {'x':>6}")
    for mib in (int(x) for x in args.budget_mib.split(",")):
        for seqs in (int(x) for x in args.seqs.split(",")):
            cfg = EngineConfig(model=model_arg, kv_cache_memory=mib << 20, max_num_seqs=seqs)
            layout = plan_kv_cache(model, cfg, cpu, engine.kv_dtype, max_len)
            one = (mib << 20) // per_all * cfg.block_size
            got = layout.num_blocks * cfg.block_size
            rows.append({"budget_mib": mib, "max_num_seqs": seqs, "one_pool_tokens": one,
                         "split_tokens": got, "window_blocks": layout.num_window_blocks,
                         "ratio": got / one})
            print(f"{mib:>10} {seqs:>5} {one:>16,} {got:>13,} {layout.num_window_blocks:>14,} "
                  f"{got / one:>6.2f}")
    write_json(args.out, {**header(__doc__, __file__), "machine": machine_info(),
                          "model": model_arg, "window": window, "sliding_layers": sliding,
                          "layers": model.config.num_layers, "rows": rows})


if __name__ == "__main__":
    main()
