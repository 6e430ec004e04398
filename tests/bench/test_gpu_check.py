"""benchmarks/gpu_check.py: its dry run (tiny shapes, Triton interpreter, engine and server on CPU)
writes every section's status and numbers, the per-architecture token agreement and the targets
to $OUT; a section that fails is reported as failed while the others still run; and the pieces
of edgellm/bench/gpu_check.py and engine_check.py it reports with."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.bench.engine_check import agreement
from edgellm.bench.gpu_check import TARGETS, parse_sections, run_section, summary, targets
from edgellm.bench.tiny_models import ARCHS
from tests.helpers.json_tree import numbers

ROOT = Path(__file__).resolve().parents[2]


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """gpu_check.py ARGS with OUT=tmp_path; (the process, the JSON it wrote or None)."""
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600, check=False)
    out = tmp_path / "gpu_check.json"
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_dry_run_reports_every_section(tmp_path):
    proc, r = run_check(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r is not None and r["dry_run"] is True and r["machine"]["cores"]
    sections = r["sections"]
    assert {name: s["status"] for name, s in sections.items()} == {"a": "ok", "b": "ok", "c": "ok", "d": "ok"}
    assert all(math.isfinite(x) for x in numbers(sections)), "a NaN or inf among the numbers"

    a = sections["a"]
    kinds = {(row["kernel"], row["M"]) for row in a["gemm"]}
    assert {("w4a16", 1), ("w8a16", 1), ("fp8", 1), ("fp16 cuBLAS", 1)} <= kinds
    assert {row["kv_dtype"] for row in a["attention"]} == {"float32", "float8_e4m3fn"}
    assert {row["q_len"] for row in a["attention"]} == {1, 9}  # decode and chunked prefill
    assert a["kv_write"] and a["worst_rel_err"] < 3e-2 and a["ceilings"]["copy_GBps"] > 0

    b = sections["b"]
    assert set(b["archs"]) == set(ARCHS) and b["note"]
    for arch, result in b["archs"].items():
        (side,) = result["sides"].values()
        assert 0.0 <= side["identical_fraction"] <= 1.0, arch
        first = side["first_divergence"]
        assert (first is None) == (side["identical_fraction"] == 1.0), (arch, side)

    c = sections["c"]
    assert c["long_prompt_ttft_ms"]["median"] > 0 and c["decode_tok_s_1_stream"] > 0
    (level,) = c["streams"].values()
    assert level["requests"] == 2 and level["total_tok_s"] > level["output_tok_s"] > 0

    d = sections["d"]  # graphs replayed on CPU by RerunBackend: the same tokens as eager
    assert d["note"] and d["archs"]["llama"]["float32"]["identical_fraction"] == 1.0
    assert d["archs"]["llama"]["float32"]["buckets"] and set(d["speed"]) == {"1", "2"}
    assert all(v["eager_tok_s"] > 0 and v["graphs_tok_s"] > 0 for v in d["speed"].values())

    assert [t["key"] for t in r["targets"]] == [t[0] for t in TARGETS]
    assert all(math.isfinite(t["value"]) and t["met"] is None for t in r["targets"])
    assert "target" in proc.stdout and "section" in proc.stdout


def test_a_failing_section_is_reported_and_the_others_run(tmp_path):
    # int4 packing needs K a multiple of 8: every GEMM of this shape (K = 60, 45, 90) raises
    proc, r = run_check(tmp_path, "--dry-run", "--sections", "a,c", "--shape", "bad:60,90,3,1,15")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r is not None
    a, b, c, d = (r["sections"][name] for name in "abcd")
    assert d["status"] == "skipped"
    assert a["status"] == "failed" and "multiple of 8" in a["error"]
    assert b["status"] == "skipped"
    assert c["status"] == "ok" and c["long_prompt_ttft_ms"]["median"] > 0
    assert "section a FAILED" in proc.stdout
    w4 = next(t for t in r["targets"] if t["key"] == "w4a16_gemv_speedup")
    assert math.isnan(w4["value"]) and w4["met"] is None


def test_an_unknown_section_is_a_usage_error(tmp_path):
    proc, r = run_check(tmp_path, "--dry-run", "--sections", "a,z")
    assert proc.returncode == 2 and "unknown section" in proc.stderr and r is None


def test_parse_sections():
    assert parse_sections("c, a,c") == ["c", "a"]
    with pytest.raises(ValueError, match="unknown section"):
        parse_sections("")


def test_agreement_counts_identical_tokens_and_finds_the_first_divergence():
    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(want, want) == {"identical_fraction": 1.0, "first_divergence": None}
    got = [[1, 2, 9, 4], [5, 0, 7, 8]]
    assert agreement(want, got) == {
        "identical_fraction": 6 / 8,
        "first_divergence": {"prompt": 1, "token": 1},
    }
    assert agreement([[1, 2]], [[1]])["first_divergence"] == {"prompt": 0, "token": 1}


def test_targets_are_judged_only_on_a_gpu():
    a = {
        "ceilings": {"copy_GBps": 1000.0},
        "gemm": [
            {"M": 1, "kernel": "w4a16", "speedup_vs_fp16": 3.5},
            {"M": 1, "kernel": "w4a16", "speedup_vs_fp16": 2.5},
            {"M": 16, "kernel": "w4a16", "speedup_vs_fp16": 0.5},
            {"M": 1, "kernel": "w4a16", "error": "failed", "speedup_vs_fp16": math.nan},
        ],
        "attention": [
            {"q_len": 1, "ctx": 8192, "GBps": 800.0},
            {"q_len": 1, "ctx": 2048, "GBps": 100.0},
            {"q_len": 512, "ctx": 8192, "GBps": 10.0},
        ],
    }
    c = {"long_prompt_ttft_ms": {"median": 40.0},
         "streams": {"16": {"ttft_p95_ms": 90.0}, "64": {"ttft_p95_ms": 250.0}}}
    got = {t["key"]: (t["value"], t["met"]) for t in targets({"a": a, "c": c}, judged=True)}
    assert got == {
        "w4a16_gemv_speedup": (2.5, False),
        "decode_attention_hbm_share": (0.8, True),
        "ttft_1k_ms": (40.0, True),
        "ttft_p95_max_streams_ms": (250.0, False),
    }
    assert all(t["met"] is None for t in targets({"a": a, "c": c}, judged=False))
    missing = targets({"a": {"status": "failed"}}, judged=True)
    assert all(math.isnan(t["value"]) and t["met"] is None for t in missing)


def test_run_section_turns_a_raise_into_a_failed_status(capsys):
    failed = run_section("b", lambda: {"x": 1 / 0})
    assert failed["status"] == "failed" and failed["error"].startswith("ZeroDivisionError")
    assert failed["seconds"] >= 0 and "section b FAILED" in capsys.readouterr().out
    ok = run_section("a", lambda: {"rows": [1]})
    assert ok["status"] == "ok" and ok["rows"] == [1]
    partial = run_section("c", lambda: {"status": "failed", "error": "one part failed"})
    assert partial["status"] == "failed" and partial["error"] == "one part failed"
    lines = summary({"a": ok, "b": failed, "c": {"status": "skipped"}}, targets({}, judged=False))
    assert any(line.startswith("b ") and "ZeroDivisionError" in line for line in lines)
    assert any(line.startswith("c ") and "not selected" in line for line in lines)
