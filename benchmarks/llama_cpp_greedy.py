"""Greedy continuations of edgellm against llama.cpp's on the same GGUF file and the same token ids.

Starts llama-server (benchmarks/build_llama_server.sh builds it) on the file, sends each prompt as
token ids to its /completion endpoint (top_k 1, temperature 0, no prompt cache, EOS ignored), and
generates the same number of tokens with edgellm in exact and in auto mode. Where a continuation
differs from llama.cpp's, the first differing position is examined in edgellm's exact logits
(teacher-forced on the common prefix) and in llama.cpp's own log-probabilities: how much more
likely each finds its token than the other's. When those two gaps together are small (less than
the log-probability differences the two show on tokens they agree on), the position is a near-tie
that two float implementations break differently (llama.cpp rounds activations to 8 bits for its
K-quant dot products); a large one would be a bug.

    python benchmarks/llama_cpp_greedy.py                     # Gemma 3 270M Q4_K_M (dev extra)
    python benchmarks/llama_cpp_greedy.py --model file.gguf --tokens 48

Writes benchmarks/results/llama_cpp_greedy.json. No asserts: what it finds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

from edgellm.bench.llama_cpp import LLAMA_DEFAULT, find_llama_server
from edgellm.bench.machine import machine_info
from edgellm.bench.servers import Server, free_port

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# a 3x3 identity matrix\n",
    "Seoul is the capital of",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]


def llama_greedy(url: str, ids: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
    """llama.cpp's greedy tokens and, per position, its log-probabilities (before sampling) of
    its 10 most likely tokens."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": True, "samplers": ["top_k"], "n_probs": 10}
    resp = httpx.post(url + "/completion", json=body, timeout=300)
    resp.raise_for_status()
    data = resp.json()
    probs = [{int(t["id"]): float(t["logprob"]) for t in p["top_logprobs"]}
             for p in data["completion_probabilities"]]
    return [int(t) for t in data["tokens"]], probs


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def edgellm_logprobs(exact: Any, ids: list[int], theirs: list[int]) -> torch.Tensor:
    """edgellm's exact log-probabilities at each of llama.cpp's positions (teacher-forced)."""
    logits = exact.prompt_logits([ids + theirs])[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(theirs)], dim=-1)


def examine(ours_lp: torch.Tensor, their_lp: list[dict[int, float]], ours: list[int],
            theirs: list[int], at: int) -> dict[str, Any]:
    """At the first differing position (the prefix before it is common): how much more likely each
    implementation finds its own token than the other's, in nats. `disagreement` is the sum, the
    amount by which the two differ on the pair's relative log-probability."""
    mine, other = ours[at], theirs[at]
    edgellm_gap = float(ours_lp[at, mine] - ours_lp[at, other])
    llama_gap = their_lp[at][other] - their_lp[at][mine] if mine in their_lp[at] else None
    return {"position": at, "edgellm_token": mine, "llama_token": other,
            "edgellm_gap": edgellm_gap, "llama_gap": llama_gap,
            "disagreement": None if llama_gap is None else edgellm_gap + llama_gap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--near-tie", type=float, default=0.5,
                    help="a difference is a near-tie when the two implementations' log-probabilities "
                         "of the two tokens disagree by less than this (nats)")
    ap.add_argument("--out", default=str(RESULTS / "llama_cpp_greedy.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from edgellm import LLM, SamplingParams
    from edgellm.bench.models import gemma3_270m_path

    path = Path(args.model) if args.model else gemma3_270m_path()
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit(f"no llama-server (looked at --llama-server, $EDGELLM_LLAMA_SERVER and "
                         f"{LLAMA_DEFAULT}); build it with benchmarks/build_llama_server.sh")
    port = free_port()
    cmd = [str(binary), "-m", str(path), "-c", "2048", "-np", "1", "-t", str(args.threads),
           "--port", str(port), "--host", "127.0.0.1"]
    server = Server("llama-server", cmd, port, Path(tempfile.mkdtemp(prefix="llama_greedy_")))
    modes = {m: LLM(str(path), cpu_quant=m, max_model_len=1024) for m in ("exact", "auto")}
    tok = modes["exact"].engine.tokenizer
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows = []
    try:
        server.start(timeout=300)
        for text in PROMPTS:
            ids = tok.encode(text)
            theirs, their_lp = llama_greedy(server.url, ids, args.tokens)
            ours_lp = edgellm_logprobs(modes["exact"], ids, theirs)
            drift = [abs(float(ours_lp[j, t]) - their_lp[j][t]) for j, t in enumerate(theirs)]
            row: dict[str, Any] = {"prompt": text, "prompt_tokens": len(ids), "llama": theirs,
                                   "llama_text": tok.decode(theirs),
                                   "logprob_difference_max": max(drift),
                                   "logprob_difference_mean": sum(drift) / len(drift)}
            for mode, llm in modes.items():
                ours = llm.generate([ids], params)[0].outputs[0].token_ids
                at = first_difference(ours, theirs)
                entry: dict[str, Any] = {"tokens": ours, "equal": at is None}
                if at is not None and at < min(len(ours), len(theirs)):
                    entry["difference"] = d = examine(ours_lp, their_lp, ours, theirs, at)
                    entry["near_tie"] = d["disagreement"] is not None and d["disagreement"] < args.near_tie
                    entry["text"] = tok.decode(ours)
                row[mode] = entry
            rows.append(row)
            print(f"{text[:40]!r:44} max |dlogp| {row['logprob_difference_max']:.3f}  "
                  f"exact {_verdict(row['exact'])}   auto {_verdict(row['auto'])}")
    finally:
        server.stop()
    summary = {m: {"equal": sum(r[m]["equal"] for r in rows),
                   "near_tie": sum(bool(r[m].get("near_tie")) for r in rows),
                   "other": sum(not r[m]["equal"] and not r[m].get("near_tie") for r in rows),
                   "prompts": len(rows)} for m in modes}
    report = {"machine": machine_info(args.threads), "model": path.name,
              "tokens": args.tokens, "near_tie_nats": args.near_tie, "llama_server": cmd[0],
              "summary": summary, "prompts": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for m, s in summary.items():
        print(f"{m}: {s['equal']}/{s['prompts']} equal to llama.cpp, {s['near_tie']} differ at a "
              f"near-tie (< {args.near_tie} nats), {s['other']} otherwise")
    print(f"wrote {args.out}")
    return 0


def _verdict(entry: dict[str, Any]) -> str:
    if entry["equal"]:
        return "equal"
    d = entry.get("difference")
    if d is None:
        return "shorter"
    llama = "n/a" if d["llama_gap"] is None else f"{d['llama_gap']:.3f}"
    return f"differs at {d['position']} (gaps {d['edgellm_gap']:.3f} / {llama})"


if __name__ == "__main__":
    raise SystemExit(main())
