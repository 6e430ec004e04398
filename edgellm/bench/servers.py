"""Servers under test, for the benchmarks and the tests: a free port, one subprocess wrapper
(`Server`) that starts a server, waits for GET /health to answer 200 and stops it, `ServerProcess`
(the same for `edgellm serve`) and `serving` (as a context manager), and what a running server
says of itself (its served model, its /metrics, its resident memory)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
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
    """name{labels} -> value from GET /metrics (the label set dropped when it is only
    model_name)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'\{model_name="[^"]*"\}', "", key)
        out[key] = float(value)
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, in bytes (VmRSS of /proc/PID/status; Linux only)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """A server subprocess on `port`, its output in `log_path` (default log_dir/NAME.log).

    start(timeout) launches it and returns once GET /health answers 200 (load_s: how long that
    took); it raises RuntimeError with the log's tail when the process exits first or the timeout
    passes (the process is then stopped). stop() terminates it (kill after 30 s) and closes the log.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log_path: Path | None = None,
    ):
        self.name = name
        self.cwd = cwd
        self.cmd = cmd
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        if log_path is None:
            if log_dir is None:
                raise ValueError("Server needs log_dir or log_path")
            log_path = log_dir / f"{name}.log"
        self.log_path = log_path
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.load_average_before = math.nan
        self.proc: subprocess.Popen | None = None
        self.log: Any = None
        self.load_s = math.nan
        self._t0 = math.nan
        # tried once, instead, when the first command dies of a signal while starting
        self.fallback: tuple[list[str], str] | None = None

    def launch(self) -> None:
        """Start the process, without waiting for it to be ready."""
        self.load_average_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
        self.log = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop())
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
        )

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Return once GET /health answers 200; raise RuntimeError when the process exits first or
        after `timeout` seconds (the process then stopped)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.load_s = time.monotonic() - self._t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{tail}")

    def start(self, timeout: float) -> None:
        """launch() and wait_ready(timeout)."""
        self.launch()
        self.wait_ready(timeout)

    def start_or_fallback(self, timeout: float) -> str | None:
        """Start; if the process crashes on a signal and a fallback is set, stop and start that
        instead. Returns the note explaining the fallback when it was used."""
        try:
            self.start(timeout)
            return None
        except RuntimeError:
            crashed = (
                self.proc is not None
                and self.proc.returncode is not None
                and self.proc.returncode < 0
            )
            if self.fallback is None or not crashed:
                raise
            self.stop()
            self.cmd, note = self.fallback
            self.fallback = None
            print(
                f"  {self.name} crashed while starting (signal {-self.proc.returncode}); {note}",
                flush=True,
            )
            self.log_path = self.log_path.with_name(self.log_path.stem + ".retry.log")
            self.start(timeout)
            return note

    def log_tail(self, n: int = 6000) -> str:
        """The last n characters of the server's output."""
        if self.log is not None and not self.log.closed:
            self.log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    log_text = log_tail

    def rss_bytes(self) -> int:
        """The server process's resident memory, in bytes."""
        assert self.proc is not None
        return rss_bytes(self.proc.pid)

    def stop(self) -> None:
        """Terminate the process (kill it after 30 s) and close the log; safe to call twice."""
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


def edgellm_serve_cmd(port: int, args: list[str]) -> list[str]:
    """The command line of `edgellm serve` on 127.0.0.1:port, access log off, then `args`."""
    return [
        sys.executable,
        "-m",
        "edgellm.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        *args,
    ]


class ServerProcess(Server):
    """`edgellm serve ARGS` on a free port, launched at construction (call wait_ready() next)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        port = free_port()
        super().__init__(
            "edgellm", edgellm_serve_cmd(port, args), port, env=env, cwd=cwd, log_path=log_path
        )
        self.launch()


@contextlib.contextmanager
def serving(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 240.0
) -> Iterator[ServerProcess]:
    """A ServerProcess, ready, stopped on exit."""
    srv = ServerProcess(args, log_path, env)
    try:
        srv.wait_ready(timeout)
        yield srv
    finally:
        srv.stop()
