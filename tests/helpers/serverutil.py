"""Helpers shared by the server tests and the reliability scripts: a real `edgellm serve` subprocess,
the real app on uvicorn in a thread, /metrics scraping, and a server's resident memory."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from edgellm.bench.servers import scrape  # noqa: F401  (the tests and reliability scripts import it from here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m edgellm.cli serve ...` on a free port; ready once /health answers."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "edgellm.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-access-log",
            *args,
        ]
        self.log = open(log_path, "wb")  # noqa: SIM115  (the server writes to it until stop())
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        log = self.log_text()  # before stop() closes the log
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{log}")

    def log_text(self, tail: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def rss_bytes(self) -> int:
        return rss_bytes(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def serving(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A ServerProcess, ready, stopped on exit (for module-scoped fixtures)."""
    srv = ServerProcess(args, log_path, env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


class ThreadServer:
    """An ASGI app on a real uvicorn (127.0.0.1, h11 as `edgellm serve` runs it) in a thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", http="h11", **config
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:  # noqa: PYI034
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def is_openai_error(body: Any) -> bool:
    """{"error": {"message": non-empty str, "type": str, "param": str|None, "code": str|None}}."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )


def build_tiny_chat_model(out: Path) -> Path:
    """A tiny random-weight Llama with the default model's real tokenizer and chat template: the
    whole server path (templates, detokenization, stop strings) at ~1 ms a step."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer
    from tests.helpers.tiny_models import tiny_config

    tok = Tokenizer.load(default_model_path(), "gguf")
    assert tok is not None
    cfg = tiny_config("llama_tied")
    cfg.vocab_size = len(tok.hf)
    cfg.bos_token_id = tok.hf.bos_token_id
    cfg.eos_token_id = tok.hf.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tok.hf.save_pretrained(str(out))
    return out


def streamed_calls(stream):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert (
                    tc.id and tc.type == "function" and tc.function.name
                )  # all in the first delta
                calls[tc.index] = {
                    "id": tc.id,
                    "name": tc.function.name,
                    "arguments": tc.function.arguments or "",
                }
            else:
                assert tc.id is None and tc.function.name is None  # never again
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish
