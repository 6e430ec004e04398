"""llama.cpp as the reference the benchmarks and the slow tests compare with.

- `find_llama_server`: the `llama-server` binary (benchmarks/build_llama_server.sh builds it from
  the llama.cpp that the llama-cpp-python sdist on PyPI vendors) and `llama_flags`, the options
  that build knows; `find_llama_bench`, the same build's `llama-bench`;
- `converter_dir`: the same vendored llama.cpp tree, for its Python GGUF converter
  (convert_hf_to_gguf.py with its `conversion` package and gguf-py). Found in the cache where the
  build script unpacks it, else the sdist is downloaded from the package registry and only the
  converter's files are unpacked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from edgellm import env

LLAMA_CPP_PY_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is used
LLAMA_DEFAULT = Path.home() / ".cache" / "edgellm" / "llama.cpp" / "build" / "bin" / "llama-server"
_VENDORED = f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}/vendor/llama.cpp"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def find_llama_server(explicit: str | None) -> Path | None:
    """The llama-server binary: `explicit`, else $EDGELLM_LLAMA_SERVER, else where
    benchmarks/build_llama_server.sh builds it; None when none of them is an executable file."""
    for cand in (explicit, env.llama_server(), str(LLAMA_DEFAULT)):
        if (
            cand
            and Path(cand).expanduser().is_file()
            and os.access(Path(cand).expanduser(), os.X_OK)
        ):
            return Path(cand).expanduser()
    return None


def find_llama_bench(server: Path | None) -> Path | None:
    """The `llama-bench` built beside `server` (the build script links both into one directory;
    also looked for beside the link's target), or None."""
    if server is None:
        return None
    for folder in (server.parent, server.resolve().parent):
        cand = folder / "llama-bench"
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def llama_bench_prompt(bench: Path, model: Path, tokens: int, threads: int, repeats: int) -> float:
    """llama.cpp's prompt processing rate in tokens/s: `llama-bench -p tokens -n 0` on `model`
    with `threads` threads, the mean of `repeats` runs. Raises RuntimeError when it fails."""
    cmd = [
        str(bench),
        "-m",
        str(model),
        "-p",
        str(tokens),
        "-n",
        "0",
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"llama-bench did not run: {exc}") from exc
    start = proc.stdout.find("[")
    if proc.returncode != 0 or start < 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    runs = [r for r in json.loads(proc.stdout[start:]) if r.get("n_prompt") == tokens]
    if not runs:
        raise RuntimeError("llama-bench printed no prompt-processing result")
    return float(runs[0]["avg_ts"])


def llama_flags(binary: Path) -> set[str]:
    """The long options this llama-server build knows (builds differ across versions)."""
    try:
        proc = subprocess.run(
            [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(re.findall(r"--[a-z][a-z0-9-]+", proc.stdout + proc.stderr))


def converter_dir() -> Path:
    """The vendored llama.cpp directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/
    (unpacked from the sdist on first use). Raises RuntimeError when the sdist cannot be had."""
    base = env.cache_dir() / "llama.cpp"
    for root in (base / "src", base / "converter"):
        found = root / _VENDORED
        if (found / "convert_hf_to_gguf.py").is_file() and (found / "conversion").is_dir():
            return found
    sdist = base / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}.tar.gz"
    if not sdist.is_file():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--dest",
            str(sdist.parent),
            f"llama-cpp-python=={LLAMA_CPP_PY_VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or not sdist.is_file():
            raise RuntimeError(
                f"cannot download llama-cpp-python {LLAMA_CPP_PY_VERSION}'s sdist:\n"
                f"{proc.stderr[-2000:]}"
            )
    target = base / "converter"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp, tarfile.open(sdist) as tar:
        wanted = [
            m
            for m in tar.getmembers()
            if m.isfile()
            and m.name.startswith(_VENDORED + "/")
            and m.name[len(_VENDORED) + 1 :].startswith(_CONVERTER_PARTS)
        ]
        tar.extractall(tmp, members=wanted, filter="data")
        out = Path(tmp) / _VENDORED
        final = target / _VENDORED
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(out, final)  # whole or not at all: a half-unpacked tree is never found
    return final
