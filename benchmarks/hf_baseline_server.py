"""A plain transformers server behind the same OpenAI API as `edgellm serve`: the baseline
that `benchmarks/compare_servers.py` measures edgellm against.

Static batching, the way a straightforward transformers deployment serves: requests
that arrive within a short window (--batch-window-ms, up to --max-batch-size) form one
batch; the prompts are left-padded and run through `model.generate()` together, and
nothing new joins until the whole batch has finished. A streamer receives the batch's
new token column every step and pushes each row's text delta to that request's queue,
so every client streams as its tokens appear. Per request: `max_tokens`, `ignore_eos`
and `temperature` (0 = greedy; per-row temperatures through a logits processor).

    python benchmarks/hf_baseline_server.py                          # the embedded default GGUF
    python benchmarks/hf_baseline_server.py --model ./hf-dir --port 8001
    python benchmarks/hf_baseline_server.py --model model.gguf --max-batch-size 16

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not),
GET /v1/models, GET /health. 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger("hf_baseline")

DEFAULT_NAME = "hf-baseline"


# ------------------------------------------------------------------ the batching core
@dataclass
class Job:
    """One request: its prompt ids, sampling settings and where its output goes."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    # filled in while generating (on the generate thread)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    # delivery: (kind, payload) events on an asyncio queue of the server's loop
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    sent_text: str = ""

    def emit(self, kind: str, payload: Any) -> None:
        if self.loop is not None and self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


def _done(job: Job, eos_ids: set[int]) -> str | None:
    """Why the job stops after its latest token (None while it goes on)."""
    if job.token_ids and not job.ignore_eos and job.token_ids[-1] in eos_ids:
        return "stop"
    if len(job.token_ids) >= job.max_tokens:
        return "length"
    return None


class BatchStreamer:
    """A generate() streamer for a whole batch: each step's token column goes to the rows
    still running, and each row's new text is pushed to its job as a delta."""

    def __init__(self, jobs: list[Job], tokenizer: Any, eos_ids: set[int]) -> None:
        self.jobs = jobs
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() hands over the (padded) prompt first
            self.prompt_seen = True
            return
        column = value.reshape(-1).tolist()
        for job, token in zip(self.jobs, column):
            if job.finish_reason is not None:
                continue
            if job.cancelled:
                job.finish_reason = "abort"
                continue
            job.token_ids.append(int(token))
            job.finish_reason = _done(job, self.eos_ids)
            self._push_text(job, final=job.finish_reason is not None)
            if job.finish_reason is not None:
                job.emit("done", job.finish_reason)

    def end(self) -> None:
        for job in self.jobs:  # rows generate() ended without our criteria (should not happen)
            if job.finish_reason is None:
                job.finish_reason = "length"
                self._push_text(job, final=True)
                job.emit("done", job.finish_reason)

    def _push_text(self, job: Job, final: bool) -> None:
        text = self.tokenizer.decode(job.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return  # an incomplete UTF-8 sequence: wait for the next token
        # byte-level BPE decodes a prefix of the tokens to a prefix of the text; if a tokenizer
        # ever rewrites earlier text, nothing is sent until the text extends what was sent
        delta = text[len(job.sent_text):] if text.startswith(job.sent_text) else ""
        if delta:
            job.sent_text += delta
            job.emit("delta", delta)


class RowStopping:
    """A StoppingCriteria: row i is finished once its job is (max_tokens, EOS unless
    ignore_eos, or a cancelled client); generate() ends when every row is."""

    def __init__(self, jobs: list[Job], prompt_len: int, eos_ids: set[int]) -> None:
        self.jobs = jobs
        self.prompt_len = prompt_len
        self.eos_ids = eos_ids
        self.limits = torch.tensor([j.max_tokens for j in jobs])
        self.eos = torch.tensor(sorted(eos_ids) or [-1])
        self.stop_on_eos = torch.tensor([not j.ignore_eos for j in jobs])
        self.hit_eos = torch.zeros(len(jobs), dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_len
        last = input_ids[:, -1].cpu()
        self.hit_eos |= torch.isin(last, self.eos) & self.stop_on_eos
        cancelled = torch.tensor([j.cancelled for j in self.jobs])
        return (self.hit_eos | (generated >= self.limits) | cancelled).to(input_ids.device)


class RowTemperature:
    """A LogitsProcessor for mixed batches: rows with temperature 0 keep only their argmax
    (greedy under sampling), the others are divided by their temperature."""

    def __init__(self, temperatures: list[float]) -> None:
        self.t = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32)
        self.greedy = torch.tensor([t <= 0 for t in temperatures])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.t.to(scores.device)[:, None]
        if bool(self.greedy.any()):
            best = scores.argmax(-1, keepdim=True)
            only_best = torch.full_like(scores, float("-inf")).scatter(1, best, 0.0)
            scores = torch.where(self.greedy.to(scores.device)[:, None], only_best, scores)
        return scores


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                  tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def prepare_model(model: Any, tokenizer: Any) -> tuple[set[int], int]:
    """Take EOS handling out of generate() (our stopping criteria decide per row, honouring
    ignore_eos) and give it a pad id. Returns (eos ids, pad id)."""
    from transformers import GenerationConfig

    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = min(eos) if eos else 0
    model.generation_config = GenerationConfig(
        eos_token_id=None, pad_token_id=pad, bos_token_id=getattr(model.config, "bos_token_id", None),
        do_sample=False, temperature=1.0, top_k=None, top_p=None,
    )
    return eos, pad


def generate_batch(model: Any, tokenizer: Any, jobs: list[Job], eos_ids: set[int], pad_id: int) -> BatchStreamer:
    """Run one static batch to completion: left-pad, generate, stream each row's deltas."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    width = max(len(j.prompt_ids) for j in jobs)
    input_ids = torch.full((len(jobs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for i, job in enumerate(jobs):
        n = len(job.prompt_ids)
        input_ids[i, width - n:] = torch.tensor(job.prompt_ids, dtype=torch.long)
        mask[i, width - n:] = 1
    streamer = BatchStreamer(jobs, tokenizer, eos_ids)
    sample = any(j.temperature > 0 for j in jobs)
    processors = LogitsProcessorList([RowTemperature([j.temperature for j in jobs])] if sample else [])
    device = next(model.parameters()).device
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device),
            max_new_tokens=max(j.max_tokens for j in jobs), min_new_tokens=0,
            do_sample=sample, pad_token_id=pad_id, streamer=streamer,
            stopping_criteria=StoppingCriteriaList([RowStopping(jobs, width, eos_ids)]),
            logits_processor=processors,
        )
    return streamer


class Batcher:
    """Groups queued jobs into static batches and runs them one after another on one thread."""

    def __init__(self, model: Any, tokenizer: Any, max_batch_size: int = 16, window_s: float = 0.02) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = prepare_model(model, tokenizer)
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.pending: asyncio.Queue[Job] | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.batch_sizes: list[int] = []  # the size of every batch run, for tests and logs
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.pending = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job) -> None:
        assert self.pending is not None, "Batcher.start() not called"
        job.loop = asyncio.get_running_loop()
        job.queue = asyncio.Queue()
        self.pending.put_nowait(job)

    async def _collect(self) -> list[Job]:
        assert self.pending is not None
        batch = [await self.pending.get()]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.pending.get(), remaining))
            except asyncio.TimeoutError:
                break
        while len(batch) < self.max_batch_size and not self.pending.empty():
            batch.append(self.pending.get_nowait())
        return [j for j in batch if not j.cancelled]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            self.batch_sizes.append(len(batch))
            try:
                await loop.run_in_executor(self.executor, generate_batch, self.model, self.tokenizer, batch,
                                           self.eos_ids, self.pad_id)
            except Exception as exc:  # every waiting client gets the error
                logger.exception("batch of %d failed", len(batch))
                for job in batch:
                    if job.finish_reason is None:
                        job.finish_reason = "error"
                        job.emit("error", f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- the API
class BadRequest(ValueError):
    pass


def _prompt_ids(tokenizer: Any, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        norm = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise BadRequest("each message needs a 'role'")
            content = m.get("content") or ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            norm.append({"role": m["role"], "content": str(content)})
        text = tokenizer.apply_chat_template(norm, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")


def _job(tokenizer: Any, body: dict[str, Any], chat: bool, max_len: int) -> Job:
    ids = _prompt_ids(tokenizer, body, chat)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    if len(ids) + max_tokens > max_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context ({max_len})")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < 0:
        raise BadRequest("'temperature' must be >= 0")
    return Job(ids, max_tokens, bool(body.get("ignore_eos", False)), temperature)


def create_app(model: Any, tokenizer: Any, served_name: str = DEFAULT_NAME, max_batch_size: int = 16,
               batch_window_ms: float = 20.0) -> Any:
    batcher = Batcher(model, tokenizer, max_batch_size, batch_window_ms / 1000)
    max_len = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)

    @asynccontextmanager
    async def lifespan(_app: Any):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.batcher = batcher

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": 0,
                                            "owned_by": "transformers"}]}

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            job = _job(tokenizer, body, chat, max_len)
        except (BadRequest, ValueError, TypeError) as exc:
            return error(400, str(exc) or "bad request")
        batcher.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model_name = str(body.get("model") or served_name)
        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        if body.get("stream"):
            return StreamingResponse(_stream(job, rid, created, model_name, chat, include_usage),
                                     media_type="text/event-stream")
        try:
            text, finish = await _collect(job)
        except RuntimeError as exc:
            return error(500, str(exc), "server_error")
        finally:
            job.cancelled = job.finish_reason is None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": _usage(job)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    return app


def _usage(job: Job) -> dict[str, int]:
    n = len(job.token_ids)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n, "total_tokens": len(job.prompt_ids) + n}


async def _collect(job: Job) -> tuple[str, str]:
    assert job.queue is not None
    parts = []
    while True:
        kind, payload = await job.queue.get()
        if kind == "delta":
            parts.append(payload)
        elif kind == "done":
            return "".join(parts), payload
        else:
            raise RuntimeError(payload)


async def _stream(job: Job, rid: str, created: int, model: str, chat: bool, include_usage: bool):
    """OpenAI SSE chunks; the first carries the role and the first text (no empty event first)."""
    assert job.queue is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    started = False

    def chunk(text: str | None, finish: str | None) -> str:
        nonlocal started
        if chat:
            delta: dict[str, Any] = {} if started else {"role": "assistant"}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        started = True
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        while True:
            kind, payload = await job.queue.get()
            if kind == "delta":
                yield chunk(payload, None)
            elif kind == "done":
                yield chunk("" if started else None, payload if payload in ("stop", "length") else "stop")
                break
            else:
                err = {"error": {"message": payload, "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
                break
        if include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": _usage(job)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if job.finish_reason is None:
            job.cancelled = True  # the client went away: its row stops at the next step


# ------------------------------------------------------------------------- loading
def load(model_path: str | None, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from an HF directory or a .gguf file (default: the embedded model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path is None:
        from edgellm.loader import default_model_path

        path = Path(default_model_path())
    else:
        path = Path(model_path).expanduser().resolve()
    kwargs: dict[str, Any] = {}
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path = path.parent
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    model.eval()
    return model, tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF directory or a .gguf file (default: the embedded model)")
    ap.add_argument("--served-model-name", default=DEFAULT_NAME)
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--batch-window-ms", type=float, default=20.0,
                    help="how long the first request of a batch waits for others to join")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    t = time.perf_counter()
    model, tokenizer = load(args.model, getattr(torch, args.dtype))
    logger.info("loaded %s in %.1fs (%s, %d torch threads)", args.model or "the default model",
                time.perf_counter() - t, args.dtype, torch.get_num_threads())
    app = create_app(model, tokenizer, args.served_model_name, args.max_batch_size, args.batch_window_ms)

    import uvicorn

    logger.info("serving on http://127.0.0.1:%d", args.port)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
