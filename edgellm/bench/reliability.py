"""The server under test of the reliability scripts (benchmarks/abort_storm.py, overload.py,
soak.py): its command-line options, and the `Target` a script drives.

Each script either starts `edgellm serve` itself (the embedded default model, with the knobs
below) or drives an existing server (--base-url; pass --pid to have its memory measured).
Figures go to stdout and to a JSON file under benchmarks/results/. No asserts: each result
carries "result": "pass" | "fail" and the reasons, and the CI tests read those. What the
scripts ask is in bench/reliability_prompts.py, how they ask it in bench/reliability_probes.py,
and how they report in bench/reliability_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from edgellm.bench.reliability_prompts import SYSTEM
from edgellm.bench.results import RESULTS
from edgellm.bench.servers import ServerProcess, rss_bytes, scrape

MODEL = "reliability"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="an existing server (default: start one)")
    g.add_argument("--model", default=MODEL, help="served model name on an existing server")
    g.add_argument(
        "--pid", type=int, default=None, help="the existing server's pid, to read its RSS"
    )
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--max-waiting-requests", type=int, default=8)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--kv-cache-memory", default="256M")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the prefill chunk budget per step (server default: 2048)",
    )
    g.add_argument("--api-key", default=None)
    p.add_argument(
        "--json",
        default=None,
        help="where to write the result (default benchmarks/results/NAME.json)",
    )


@dataclass
class Target:
    url: str
    model: str
    pid: int | None
    headers: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    max_num_seqs: int = 0
    max_waiting_requests: int = 0

    def rss_mb(self) -> float | None:
        return rss_bytes(self.pid) / 2**20 if self.pid else None

    def metrics(self) -> dict[str, float]:
        return scrape(self.url, self.headers)

    def log_problems(self) -> dict[str, int]:
        """Tracebacks and ERROR lines the server logged (only when this script started it)."""
        if self.log_path is None:
            return {}
        text = self.log_path.read_text(errors="replace")
        return {
            "tracebacks": text.count("Traceback"),
            "error_lines": text.count(" ERROR ") + text.count("ERROR:"),
            "critical_lines": text.count("CRITICAL"),
        }


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[Target]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.base_url:
        yield Target(
            args.base_url.rstrip("/"),
            args.model,
            args.pid,
            headers,
            max_num_seqs=args.max_num_seqs,
            max_waiting_requests=args.max_waiting_requests,
        )
        return
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "models.yaml"
        cfg.write_text(
            f"models:\n  {MODEL}:\n    source: default\n    max_model_len: {args.max_model_len}\n"
            f"    warm_prompts:\n      - {json.dumps(SYSTEM)}\n"
        )
        extra = ["--api-key", args.api_key] if args.api_key else []
        if args.max_num_batched_tokens:
            extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        srv = ServerProcess(
            [
                "--config",
                str(cfg),
                "--model",
                MODEL,
                "--kv-cache-memory",
                args.kv_cache_memory,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-waiting-requests",
                str(args.max_waiting_requests),
                *extra,
            ],
            Path(d) / "server.log",
        )
        try:
            srv.wait_ready()
            yield Target(
                srv.url,
                MODEL,
                srv.proc.pid,
                headers,
                Path(d) / "server.log",
                args.max_num_seqs,
                args.max_waiting_requests,
            )
        finally:
            srv.stop()
            # a log with errors in it is kept next to the results, for a post-mortem
            log = Path(d) / "server.log"
            if log.is_file():
                text = log.read_bytes()
                if b"Traceback" in text or b" ERROR " in text or b"CRITICAL" in text:
                    out = RESULTS / f"{Path(sys.argv[0]).stem}.server.log"
                    out.write_bytes(text[-2_000_000:])
                    print(f"the server logged errors: {out}")
