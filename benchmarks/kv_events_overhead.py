"""What publishing KV-cache events costs decode: 16 streams with events off, on with no subscriber,
and on with a ZMQ subscriber attached (another process reading every batch, as a router does).

Two engines on the embedded default model in this process (events off; events on, vLLM's ZMQ
publisher on a free 127.0.0.1 port), stepped one at a time. One trial: --streams requests with
distinct --prompt-len-token prompts, prefilled, then timed over the decode steps until each has
--new-tokens tokens; decode tok/s = tokens generated in those steps / their wall time. A decode step
of 16 streams fills a KV block every step or so, and every full block is a BlockStored event, so the
publisher is busy throughout. The modes are interleaved trial by trial (--trials rounds) and
compared by medians, so the machine's drift hits all three alike.

    python benchmarks/kv_events_overhead.py [--trials 7] [--streams 16] [--new-tokens 128]

Writes benchmarks/results/kv_events_overhead.json. No asserts: the numbers are reported as measured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from edgellm.bench.datasets import random_requests
from edgellm.bench.machine import machine_info
from edgellm.bench.results import header, write_json
from edgellm.bench.servers import free_port
from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.kv_publisher import KVEventsConfig
from edgellm.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
TOPIC = "kv@bench"


def subscribe(endpoint: str, ready: Any, stop: Any, counts: Any) -> None:
    """A SUB socket on `endpoint` reading every message until `stop` is set; counts[0] messages,
    counts[1] payload bytes."""
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.setsockopt(zmq.RCVTIMEO, 100)
    sub.connect(endpoint)
    ready.set()
    while not stop.is_set():
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            continue
        counts[0] += 1
        counts[1] += len(frames[-1])
    sub.close(0)
    ctx.term()


def decode_trial(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, int]:
    """Prefill every prompt, then time the decode steps: (decode tokens/s, events published)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while any(len(s.output_token_ids) == 0 for s in engine.seqs.values()):
        engine.step()
    done_before = sum(len(s.output_token_ids) for s in engine.seqs.values())
    t0 = time.perf_counter()
    generated = 0
    while engine.seqs:
        generated += len(engine.step())
    elapsed = time.perf_counter() - t0
    # the step outputs count one per sequence per step; the prefill already gave done_before tokens
    tokens = len(prompts) * new_tokens - done_before
    engine.block_manager.reset_prefix_cache()  # the next trial prefills again: the same work each time
    return tokens / elapsed, generated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(RESULTS / "kv_events_overhead.json"))
    args = ap.parse_args()

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC)
    plain = LLMEngine(EngineConfig(max_num_seqs=64, max_model_len=2048))
    publishing = LLMEngine(EngineConfig(max_num_seqs=64, max_model_len=2048, kv_events=events))
    prompts = [plain.tokenizer.encode_chat(r.messages) for r in
               random_requests(plain.tokenizer, args.streams, args.prompt_len, 0, 0.0, 7, True)]
    # one unmeasured trial each: kernels built, allocations made
    decode_trial(plain, prompts, 8, "warm")
    decode_trial(publishing, prompts, 8, "warm")

    ctx = mp.get_context("spawn")
    ready, stop, counts = ctx.Event(), ctx.Event(), ctx.Array("q", 2)
    subscriber = None
    modes = ("events off", "events on, no subscriber", "events on, subscriber attached")
    rates: dict[str, list[float]] = {m: [] for m in modes}
    received = 0
    try:
        for trial in range(args.trials):
            for mode in modes:
                if mode.endswith("attached") and subscriber is None:
                    subscriber = ctx.Process(target=subscribe, args=(endpoint, ready, stop, counts), daemon=True)
                    subscriber.start()
                    ready.wait(60)
                    time.sleep(0.5)  # the SUB connection completes
                elif not mode.endswith("attached") and subscriber is not None:
                    stop.set()
                    subscriber.join(30)
                    received += counts[0]
                    subscriber, counts = None, ctx.Array("q", 2)
                    stop.clear()
                    ready.clear()
                engine = plain if mode == "events off" else publishing
                rate, _ = decode_trial(engine, prompts, args.new_tokens, f"t{trial}")
                rates[mode].append(rate)
            print(f"trial {trial}: " + "  ".join(f"{m}: {rates[m][-1]:.1f}" for m in modes), flush=True)
    finally:
        if subscriber is not None:
            stop.set()
            subscriber.join(30)
            received += counts[0]
        publishing.close()
    medians = {m: statistics.median(v) for m, v in rates.items()}
    base = medians["events off"]
    out = {
        **header(__doc__, __file__), "machine": machine_info(torch.get_num_threads()),
        "config": vars(args), "decode_tok_s": rates, "median_decode_tok_s": medians,
        "slowdown_vs_events_off": {m: 1 - medians[m] / base for m in modes[1:]},
        "batches_received_by_subscriber": received,
    }
    for m in modes:
        print(f"{m:32s} median {medians[m]:7.1f} tok/s  ({1 - medians[m] / base:+.2%} slowdown)")
    print(f"subscriber received {received} batches")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
