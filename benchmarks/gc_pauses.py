"""What Python's garbage collector costs the API server process of `edgellm serve`, with its
start-up heap frozen (edgellm/engine/upkeep.freeze_startup_heap, what `edgellm serve` does once
loaded) and not. The real app (server/launch.serving_app, the engine core in its own process)
runs on uvicorn in this process, with every collection of this process timed (gc.callbacks);
`edgellm bench` drives it from a subprocess, unfrozen and frozen in turn. First, one full
collection of the loaded heap is timed each way.

    python benchmarks/gc_pauses.py [--model FILE] [--concurrency 16] [--prompts 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from edgellm.bench.machine import machine_info
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.bench.servers import free_port
from edgellm.cli import build_parser
from edgellm.engine.upkeep import freeze_startup_heap
from edgellm.server.launch import select_spec, serving_app, uvicorn_config


class Pauses:
    """Every collection's generation and milliseconds, while recording."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.events.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def summary(self) -> dict:
        full = [ms for gen, ms in self.events if gen == 2]
        return {
            "collections": len(self.events),
            "full_collections": len(full),
            "gc_total_ms": sum(ms for _, ms in self.events),
            "full_collection_ms": full,
            "longest_ms": max((ms for _, ms in self.events), default=0.0),
        }


def full_collection_ms(repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def bench(url: str, concurrency: int, prompts: int) -> dict:
    """`edgellm bench` against url: its TTFT / ITL summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        flags = {
            "--base-url": url,
            "--num-prompts": prompts,
            "--max-concurrency": concurrency,
            "--input-len": 128,
            "--output-len": 64,
            "--json": out,
        }
        cmd = [sys.executable, "-m", "edgellm.cli", "bench", "--no-progress"]
        for flag, value in flags.items():
            cmd += [flag, str(value)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "gc_pauses.json"))
    args = ap.parse_args()
    port = free_port()
    serve_args = ["serve", "--port", str(port), "--no-access-log"]
    serve_args += ["--model", args.model] if args.model else []
    sargs = build_parser().parse_args(serve_args)
    app, served = serving_app(sargs, select_spec(sargs), None)  # no after_load: frozen per round
    server = __import__("uvicorn").Server(uvicorn_config(app, sargs))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        raise SystemExit("the server did not become ready")
    gc.collect()
    tracked = len(gc.get_objects())
    unfrozen_ms = full_collection_ms()
    frozen = freeze_startup_heap()
    frozen_ms = full_collection_ms()
    gc.unfreeze()
    print(
        f"API process: {tracked} tracked objects; one full collection {unfrozen_ms:.1f} ms "
        f"unfrozen, {frozen_ms:.3f} ms with {frozen} frozen"
    )
    pauses = Pauses()
    runs: dict[str, list[dict]] = {"unfrozen": [], "frozen": []}
    try:
        for r in range(args.rounds):
            for mode in ("unfrozen", "frozen"):
                if mode == "frozen":
                    freeze_startup_heap()
                pauses.events = []
                result = bench(url, args.concurrency, args.prompts)
                if mode == "frozen":
                    gc.unfreeze()
                s = {**pauses.summary(), "bench": result}
                runs[mode].append(s)
                print(
                    f"round {r} {mode:8s}: {s['collections']} collections, {s['full_collections']} "
                    f"full ({', '.join(f'{ms:.0f}' for ms in s['full_collection_ms']) or '-'} ms), "
                    f"longest {s['longest_ms']:.1f} ms, {s['gc_total_ms']:.0f} ms in all"
                )
    finally:
        server.should_exit = True
        thread.join(30)
        if served.engine is not None:
            served.engine.shutdown()
    write_json(
        args.out,
        {
            **header(__doc__, __file__),
            "machine": machine_info(),
            "tracked_objects": tracked,
            "full_collection_ms": {"unfrozen": unfrozen_ms, "frozen": frozen_ms},
            "frozen_objects": frozen,
            "concurrency": args.concurrency,
            "prompts": args.prompts,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
