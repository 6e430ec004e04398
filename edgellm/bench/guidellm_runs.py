"""Running the two clients of benchmarks/guidellm_check.py against one `edgellm serve`.

GuideLLM's and `edgellm bench`'s command lines for the same workload (chat completions, streamed,
greedy, ignore_eos, the same lengths, concurrency, request count and seed); each tool run bounded
in wall time, offline (`OFFLINE_ENV`: nothing fetched from the Hugging Face hub), with the CPU time
it used; the served model's tokenizer saved as a Hugging Face directory for GuideLLM; warm-up
requests unrelated to either tool's prompts; and the versions of what is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from edgellm.bench.client import Target, send_one
from edgellm.bench.datasets import BenchRequest

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def guidellm_executable() -> str | None:
    """The `guidellm` next to this Python, else on PATH; None when it is not installed."""
    return shutil.which("guidellm", path=str(Path(sys.executable).parent)) or shutil.which(
        "guidellm"
    )


def versions() -> dict[str, str]:
    """Versions of python and of the packages compared (or "not installed")."""
    out: dict[str, str] = {"python": platform.python_version()}
    for pkg in ("torch", "guidellm", "edgellm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def warm_up(url: str, model: str, n: int = 4) -> None:
    """A few short streamed requests, unrelated to either tool's prompts (no prefix-cache help)."""
    target = Target(url, model, "chat", ignore_eos=True)
    for i in range(n):
        msg = [{"role": "user", "content": f"Warm-up request {i}: count slowly to twenty."}]
        result = send_one(target, BenchRequest(msg, None, 0, 16), 300)
        if result is None or not result.ok:
            raise RuntimeError(f"warm-up request failed: {result.error if result else 'no answer'}")


def save_tokenizer(model: str | None, out_dir: Path) -> Path:
    """The served model's tokenizer as a Hugging Face directory (GuideLLM loads it with
    AutoTokenizer)."""
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    src = Path(model) if model else default_model_path()
    tok = Tokenizer.load(src, "gguf" if src.suffix == ".gguf" else "safetensors")
    if tok is None:
        raise RuntimeError(f"{src}: no tokenizer found")
    tok.hf.save_pretrained(str(out_dir))
    return out_dir


def _run(cmd: list[str], log_path: Path, timeout: float) -> tuple[int, float, float]:
    """Run a tool; returns (exit code, wall seconds, CPU seconds the tool and its children used)."""
    env = {**os.environ, **OFFLINE_ENV}
    t0 = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            rc = 124
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return rc, time.monotonic() - t0, cpu


def guidellm_cmd(
    url: str, model: str, tokenizer_dir: Path, args: argparse.Namespace, out: Path
) -> list[str]:
    exe = guidellm_executable()
    base = [exe] if exe else [sys.executable, "-m", "guidellm"]
    # Greedy decoding like `edgellm bench` (GuideLLM sends no temperature, so the server would
    # otherwise sample at its default temperature, a different per-step cost).
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "http2": False,
        "request_format": "/v1/chat/completions",
        "timeout": args.request_timeout,
        "extras": {"body": {"temperature": 0.0}},
    }
    return [
        *base,
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        f"kind=concurrent,streams={args.concurrency}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
        "--seed",
        f"kind=static,value={args.seed}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]


def edgellm_bench_cmd(
    url: str, model: str, tokenizer: str | None, args: argparse.Namespace, out: Path
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "edgellm.cli",
        "bench",
        "--base-url",
        url,
        "--model",
        model,
        "--endpoint",
        "chat",
        "--dataset",
        "random",
        "--num-prompts",
        str(args.requests),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--range-ratio",
        "0",
        "--max-concurrency",
        str(args.concurrency),
        "--seed",
        str(args.seed),
        "--timeout",
        str(args.request_timeout),
        "--duration",
        str(args.tool_timeout),
        "--json",
        str(out),
        "--no-progress",
    ]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return cmd


def run_tool(
    name: str, cmd: list[str], json_path: Path, log_path: Path, timeout: float
) -> dict[str, Any]:
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    rc, wall, cpu = _run(cmd, log_path, timeout)
    if not json_path.exists() or (name == "guidellm" and rc != 0):
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} failed (exit {rc}):\n{tail}")
    print(f"[{name}] done in {wall:.0f} s, client CPU {cpu:.0f} s (exit {rc})", flush=True)
    return {"exit_code": rc, "wall_s": wall, "client_cpu_s": cpu, "command": cmd}
