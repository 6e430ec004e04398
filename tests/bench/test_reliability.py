"""Reliability under load, at CI size: the abort storm, overload and soak scripts of benchmarks/
run against one real `edgellm serve` (the embedded default model) and their JSON verdicts are
checked. The full sizes are the same scripts with their defaults:

    python benchmarks/abort_storm.py     # 10,000 cancelled streams
    python benchmarks/overload.py        # 5 waves of 10x capacity
    python benchmarks/soak.py            # 30 minutes of mixed traffic at saturation
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.serverutil import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SEQS, WAITING = 4, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    cfg = d / "models.yaml"
    system = ("You are a friendly voice assistant for a travel company. Answer in two or three short spoken "
              "sentences, without lists or markdown.")
    cfg.write_text(f"models:\n  reliability:\n    source: default\n    max_model_len: 1024\n"
                   f"    warm_prompts:\n      - {json.dumps(system)}\n")
    # exact CPU kernels: the scripts check every admitted answer against the same prompt served
    # alone, token for token, which only the batch-invariant mode guarantees
    srv = ServerProcess(["--config", str(cfg), "--model", "reliability", "--kv-cache-memory", "128M",
                         "--cpu-quant", "exact",
                         "--max-num-seqs", str(SEQS), "--max-waiting-requests", str(WAITING),
                         "--max-num-batched-tokens", "256"], d / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def run_script(server: ServerProcess, script: str, tmp_path: Path, *args: str, timeout: float = 900) -> dict:
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--base-url", server.url,
         "--pid", str(server.proc.pid), "--max-num-seqs", str(SEQS), "--max-waiting-requests", str(WAITING),
         "--json", str(out), *args],
        capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print(proc.stdout)
    return result


def server_log_is_clean(server: ServerProcess) -> None:
    text = server.log_path.read_text(errors="replace")
    assert "Traceback" not in text, server.log_text()
    assert "CRITICAL" not in text


def test_abort_storm(server, tmp_path):
    r = run_script(server, "abort_storm", tmp_path, "--requests", "120", "--warmup", "30", "--concurrency", "6",
                   "--long-words", "400", "--probe-interval", "1.0")
    assert r["result"] == "pass", r["failures"]
    assert r["after"] == {"running": 0.0, "waiting": 0.0, "kv_blocks_held": 0.0,
                          "kv_blocks_total": r["after"]["kv_blocks_total"], "in_flight": 0.0}
    # every cancel point was hit
    assert all(r["cancel_points"].get(k, 0) > 0 for k in ("before_headers", "before_token", "mid_prefill",
                                                          "mid_decode")), r["cancel_points"]
    assert r["five_xx"] == 0 and r["error_events"] == 0
    assert r["probes"]["failed"] == 0 and r["probes"]["count"] > 0 and r["final_request_ok"]
    assert r["rss_mb"]["delta_after_warmup"] <= 8.0
    server_log_is_clean(server)


def test_overload(server, tmp_path):
    r = run_script(server, "overload", tmp_path, "--waves", "1", "--max-tokens", "16", "--questions", "4")
    assert r["result"] == "pass", r["failures"]
    assert r["concurrent_per_wave"] == 10 * (SEQS + WAITING)
    assert r["admitted"] >= SEQS + WAITING and r["rejected"] > 0
    assert r["rejected_with_retry_after"] == r["rejected"] and r["other_5xx"] == 0
    assert r["admitted_wrong_output"] == 0
    assert r["lone_503_at_full_server_ms"]["count"] == 0 or r["lone_503_at_full_server_ms"]["p50"] < 1000
    server_log_is_clean(server)


def test_soak_short(server, tmp_path):
    r = run_script(server, "soak", tmp_path, "--duration", "45", "--max-tokens", "16", "--questions", "3")
    assert r["result"] == "pass", r["failures"]
    assert r["errors"] == 0 and r["mismatches"] == 0 and r["requests"] > 10
    assert r["kv_blocks_held"]["after"] == 0
    server_log_is_clean(server)


@pytest.mark.slow
def test_soak_two_minutes(server, tmp_path):
    r = run_script(server, "soak", tmp_path, "--duration", "120", "--max-tokens", "24")
    assert r["result"] == "pass", r["failures"]
    assert r["errors"] == 0 and r["mismatches"] == 0
    assert r["kv_blocks_held"]["after"] == 0
    server_log_is_clean(server)
