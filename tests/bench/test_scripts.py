"""Every script in benchmarks/ stays runnable: `--help` works for each (the list is the glob, so a
new script is covered without editing this file), and each has a quick mode, a tiny run of its
real code path whose JSON output is checked. A script that needs what this machine may lack
(llama.cpp's llama-server, GuideLLM, a router, a GPU) runs what it can or is skipped with the
reason; the reliability scripts and the GPU dry run have their own tests (named in COVERED)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from edgellm.bench.servers import Server, free_port
from tests.helpers.json_tree import numbers

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))

# scripts whose quick run lives in another test module
COVERED = {
    "abort_storm": "tests/bench/test_reliability.py",
    "overload": "tests/bench/test_reliability.py",
    "soak": "tests/bench/test_reliability.py",
    "gpu_kernels": "tests/bench/test_gpu_script.py",
    "gpu_check": "tests/bench/test_gpu_check.py",
}


def run_script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/NAME.py ARGS` from the repository root; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_json(name: str, tmp_path: Path, *args: str, flag: str = "--out", timeout: float = 600) -> Any:
    """Run the script with its output JSON sent to tmp_path; returns the parsed JSON."""
    out = tmp_path / f"{name}.json"
    run_script(name, *args, flag, str(out), timeout=timeout)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name):
    proc = run_script(name, "--help", timeout=120)
    assert "usage:" in proc.stdout.lower()


# ------------------------------------------------------------------------------ quick modes
def quick_cpu_int_dot(tmp_path):
    r = run_json("cpu_int_dot", tmp_path, "--rows", "1", "--layers", "1")
    assert r["ms_per_layer"] and all(x > 0 for x in numbers(r["ms_per_layer"]))


def quick_cpu_native_ab(tmp_path):
    r = run_json("cpu_native_ab", tmp_path, "--base", "HEAD", "--rows", "1,9", "--tokens", "16", "--linear", "g16-6",
                 "--repeats", "1", "--head", "50x64", "--head-rows", "2", "--decode", "1x40", "--decode-heads", "4x2x32")
    assert set(r["int8 head ms"]) == {"2"} and r["int8 head ms"]["2"]["this"] > 0
    assert r["decode_attention 4x2x32 ms per step"]["1x40"]["base"] > 0
    assert set(r["int_linear_n16 ms per layer"]) == {"1", "9"} and set(r["prefill_attention ms per layer"]) == {"16"}
    assert all(x > 0 for x in numbers(r["int_linear_n16 ms per layer"]))


def quick_gguf_kquant_decode(tmp_path):
    r = run_json("gguf_kquant_decode", tmp_path, "--rows", "1", "--layers", "1", "--widened")
    assert set(r["ms_per_layer"]["1"]) >= {"Q4_0", "Q4_K", "Q6_K", "Q5_0", "Q5_0 (8-bit)", "Q4_K (fp32 scales)"}
    assert all(x > 0 for x in numbers(r["ms_per_layer"]))
    assert r["stored_bits"]["Q5_0"] == [5] and r["stored_bits"]["Q6_K"] == [6]
    assert r["stored_bits"]["Q6_K (8-bit)"] == [8] and set(r["narrow_vs_8bit"]["1"]) >= {"Q5_0", "Q6_K"}
    bytes_ = r["scale_bytes_per_layer"]  # compact K-quant scales: well under half the fp32 form's bytes
    assert 0 < bytes_["Q4_K"] < bytes_["Q4_K (fp32 scales)"] / 2
    assert set(r["compact_vs_fp32_scales"]["1"]) == {"Q4_K", "Q5_K", "Q6_K", "Q4_K_M mix"}
    assert r["Q4_0_symmetric_vs_offsets"]["1"] > 0 and bytes_["Q4_0"] < bytes_["Q4_0 (offsets)"]


def quick_kv_events_overhead(tmp_path):
    r = run_json("kv_events_overhead", tmp_path, "--trials", "1", "--streams", "1", "--prompt-len", "8",
                 "--new-tokens", "4")
    assert r["machine"]["cores"] and all(v > 0 for v in r["median_decode_tok_s"].values())


def quick_prefix_attention(tmp_path):
    r = run_json("prefix_attention", tmp_path, "--chunks", "2", "--turn", "5", "--prefix", "64", "--repeats", "1")
    assert set(r["ms_per_layer"]) == {"flash-fp32", "scores-fp32", "flash-bf16", "scores-bf16"}
    assert all(x > 0 for x in r["ms_per_layer"].values())
    assert set(r["chosen_prefix_kernel"]) == {"bf16", "fp32"}
    assert set(r["chosen_prefix_kernel"].values()) <= {"flash", "scores"}


def quick_profile_decode(tmp_path):
    r = run_json("profile_decode", tmp_path, "--batch", "1", "--prompt-len", "8", "--steps", "2")
    assert r["rows"] and r["rows"][0]["tok_s"] > 0
    r = run_json("profile_decode", tmp_path, "--batch", "2", "--prompt-len", "8", "--steps", "2", "--temperature", "0.7")
    assert r["temperature"] == 0.7 and r["rows"][0]["phases_ms"]["sample"] > 0


def quick_kv_dtype_decode(tmp_path):
    r = run_json("kv_dtype_decode", tmp_path, "--batch", "2", "--context", "24", "--rounds", "1", "--steps", "1")
    assert r["kv_cache_dtypes"] == {"fp32": "float32", "fp16": "float16"}
    (row,) = r["rows"]
    assert row["step_ms"]["fp32"] > 0 and row["step_speedup_x"]["fp16"] > 0
    assert row["attention_op_ms_per_layer"]["fp16"] > 0


def quick_gc_pauses(tmp_path):
    r = run_json("gc_pauses", tmp_path, "--prompts", "2", "--concurrency", "1", "--rounds", "1")
    assert r["tracked_objects"] > 0 and r["frozen_objects"] > 0
    assert r["full_collection_ms"]["frozen"] < r["full_collection_ms"]["unfrozen"]
    assert len(r["runs"]["unfrozen"]) == len(r["runs"]["frozen"]) == 1


def quick_row_argmax(tmp_path):
    r = run_json("row_argmax", tmp_path, "--rows", "2", "--vocab", "5000", "--repeats", "1")
    assert [(x["rows"], x["vocab"]) for x in r["results"]] == [(2, 5000)]
    assert r["results"][0]["torch_argmax_ms"] > 0 and r["results"][0]["row_argmax_ms"] > 0


def quick_structured_outputs(tmp_path):
    r = run_json("structured_outputs", tmp_path, "--tokens", "4", "--repeats", "1")
    assert r["decode"]["1_streams"]["json_schema"]["tokens_per_s_median"] > 0
    assert r["first_schema_compile_ms"] > 0


def quick_offline_throughput(tmp_path):
    r = run_json("offline_throughput", tmp_path, "--new-tokens", "2", "--repeats", "1")
    assert r["machine"]["cpu"] and numbers(r)


def quick_cpu_quant_accuracy(tmp_path):
    r = run_json("cpu_quant_accuracy", tmp_path, "--chunks", "1", "--chunk-tokens", "16")
    assert r["machine"]["cpu"] and numbers(r)
    assert r["modes"]["exact"]["sampling_kl_mean"] == 0
    assert r["modes"]["auto, sampling rows"]["sampling_kl_mean"] > 0


def quick_cpu_quant_decode(tmp_path):
    r = run_json("cpu_quant_decode", tmp_path, "--new-tokens", "2", "--repeats", "1")
    assert r["bandwidth"]["read_GBps"] > 0 and r["gemm_sweep_gate_up"]


def quick_convert_report(tmp_path):
    r = run_json("convert_report", tmp_path, "--schemes", "w4a16-rtn", "--num-samples", "2",
                 "--seq-len", "16")
    assert [row["scheme"] for row in r["rows"]] == ["w4a16-rtn"]


def quick_serve_latency(tmp_path):
    r = run_json("serve_latency", tmp_path, "--concurrency", "1", "--requests-per-client", "1",
                 "--max-tokens", "4")
    (row,) = r["rows"]
    assert row["requests"] == 1 and row["ttft_p50_ms"] > 0 and row["total_tokens_per_s"] > 0


def quick_compare_servers(tmp_path):
    r = run_json("compare_servers", tmp_path, "--servers", "edgellm", "--quick", "--concurrency", "1",
                 "--no-roofline", "--input-len", "16", "--output-len", "4")
    assert r["machine"]["cores"] and r["servers"]["edgellm"]["status"] == "ok"
    assert all(row["completed"] > 0 for row in r["servers"]["edgellm"]["levels"])


def quick_voice_ttft(tmp_path):
    r = run_json("voice_ttft", tmp_path, "--requests", "2", "--concurrency", "1", "--closed-loop-only",
                 "--tools", "4")
    assert [run["tools"] for run in r["runs"]] == [0, 4]
    assert all(run["completed"] > 0 and run["failed"] == 0 for run in r["runs"])
    r = run_json("voice_ttft", tmp_path, "--wave-only")
    wave, floor = r["wave"], r["wave"]["floor"]
    assert wave["new_tokens"] > 8 * 16 and wave["prefill_step_ms"] > 0
    assert floor["gmacs"]["linears"] > floor["gmacs"]["attention"] > 0
    # no step beats its compute floor (the rates are this CPU's best matmuls, measured in the run)
    assert 0 < floor["floor_ms"]["total"] < wave["prefill_step_ms"]


def quick_router_scaleout(tmp_path):
    # no router here: the reference run alone (one replica, no router in front)
    r = run_json("router_scaleout", tmp_path, "--runs", "", "--personas", "1", "--callers", "2", "--turns",
                 "1", "--concurrency", "2", "--think-time", "0", "--system-len", "32", "--output-len", "4",
                 "--kv-cache-memory", "32M", "--duration", "120")
    assert [row["run"] for row in r["runs"]] == ["reference"] and r["runs"][0]["completed"] > 0


def quick_guidellm_check(tmp_path):
    if shutil.which("guidellm", path=str(Path(sys.executable).parent)) is None:
        # an optional tool, not in the dev extra (`pip install guidellm` brings its own stack)
        pytest.skip("GuideLLM is not installed (optional: pip install guidellm)")
    r = run_json("guidellm_check", tmp_path, "--requests", "2", "--concurrency", "1", "--rounds", "1",
                 "--input-len", "16", "--output-len", "4")
    assert r["comparison"]


def quick_kv_capacity(tmp_path):
    from tests.helpers.tiny_models import build_tiny

    path, _ = build_tiny("gemma3", tmp_path / "gemma3")  # one sliding layer (window 24), one global
    r = run_json("kv_capacity", tmp_path, "--model", str(path), "--budget-mib", "4", "--seqs", "1,64")
    one, many = r["rows"]
    assert r["window"] == 24 and r["sliding_layers"] == 1
    assert one["split_tokens"] > one["one_pool_tokens"]  # one sequence: the window pool is small
    assert many["split_tokens"] >= many["one_pool_tokens"]  # never fewer than one pool


def quick_llama_cpp_greedy(tmp_path):
    from edgellm.bench.llama_cpp import find_llama_server

    if find_llama_server(None) is None:
        # a C++ build of llama.cpp (about 15 min on 2 cores) that CI does not make
        pytest.skip("no llama-server build here (make one with benchmarks/build_llama_server.sh)")
    r = run_json("llama_cpp_greedy", tmp_path, "--tokens", "2")
    assert r["machine"]["cpu"]


def quick_hf_baseline_server(tmp_path):
    from tests.helpers.serverutil import build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path / "tiny")
    port = free_port()
    server = Server("hf_baseline", [sys.executable, str(ROOT / "benchmarks" / "hf_baseline_server.py"),
                                    "--model", str(model), "--port", str(port), "--threads", "1"],
                    port, tmp_path)
    try:
        server.start(300)
        body = {"model": "hf-baseline", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


QUICK = {name[len("quick_"):]: fn for name, fn in dict(globals()).items() if name.startswith("quick_")}
FAST = {"cpu_int_dot", "gguf_kquant_decode", "kv_capacity", "prefix_attention", "profile_decode",
        "row_argmax"}  # the rest: over ~30 s each


def test_every_script_has_a_quick_mode():
    assert set(SCRIPTS) == set(QUICK) | set(COVERED), set(SCRIPTS) ^ (set(QUICK) | set(COVERED))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in sorted(QUICK)])
def test_quick_mode(name, tmp_path):
    QUICK[name](tmp_path)
