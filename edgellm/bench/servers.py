"""Servers under test, for the benchmarks: a free port, one subprocess wrapper that starts a
server, waits for GET /health to answer 200, and stops it, and what a running server says of itself
(its served model, its /metrics)."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(url: str) -> str:
    """The first model id GET /v1/models lists."""
    resp = httpx.get(url + "/v1/models", timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """name{labels} -> value from GET /metrics (the label set dropped when it is only model_name)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'\{model_name="[^"]*"\}', "", key)
        out[key] = float(value)
    return out


class Server:
    """A server subprocess on a free port; ready once GET /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.name = name
        self.cwd = cwd
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.load_average_before = math.nan
        self.proc: subprocess.Popen | None = None
        self.log: Any = None
        self.load_s = math.nan
        # tried once, instead, when the first command dies of a signal while starting
        self.fallback: tuple[list[str], str] | None = None

    def start(self, timeout: float) -> None:
        self.load_average_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
        self.log = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop())
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.load_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def start_or_fallback(self, timeout: float) -> str | None:
        """Start; if the process crashes on a signal and a fallback is set, stop and start that
        instead. Returns the note explaining the fallback when it was used."""
        try:
            self.start(timeout)
            return None
        except RuntimeError:
            crashed = self.proc is not None and self.proc.returncode is not None and self.proc.returncode < 0
            if self.fallback is None or not crashed:
                raise
            self.stop()
            self.cmd, note = self.fallback
            self.fallback = None
            print(f"  {self.name} crashed while starting (signal {-self.proc.returncode}); {note}", flush=True)
            self.log_path = self.log_path.with_name(self.log_path.stem + ".retry.log")
            self.start(timeout)
            return note

    def log_tail(self, n: int = 3000) -> str:
        if self.log is not None:
            self.log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.log is not None:
            self.log.close()
            self.log = None
