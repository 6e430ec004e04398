"""Helpers of the server tests: the real app on uvicorn in a thread, a tiny chat model, streamed
tool calls; and, from edgellm.bench (shared with the benchmarks), a real `edgellm serve`
subprocess (ServerProcess, serving), free_port, /metrics scraping, a server's resident memory and
the OpenAI error shape check."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from edgellm.bench.reliability_report import is_openai_error  # noqa: F401  (re-exported for the tests)
from edgellm.bench.servers import (  # noqa: F401  (re-exported for the tests)
    ServerProcess,
    free_port,
    rss_bytes,
    scrape,
    serving,
)


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
