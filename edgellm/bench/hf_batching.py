"""The batching core of the transformers baseline server (edgellm/bench/hf_baseline.py):
static batches, the way a straightforward transformers deployment serves. Requests that arrive
within a short window form one batch; the prompts are left-padded and run through
`model.generate()` together, and nothing new joins until the whole batch has finished. A streamer
receives the batch's new token column every step and pushes each row's text delta to that
request's queue. Per request: `max_tokens`, `ignore_eos` and `temperature` (0 = greedy; per-row
temperatures through a logits processor). `load` reads the model and tokenizer."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("hf_baseline")


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
        delta = text[len(job.sent_text) :] if text.startswith(job.sent_text) else ""
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
    for value in (
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
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
        eos_token_id=None,
        pad_token_id=pad,
        bos_token_id=getattr(model.config, "bos_token_id", None),
        do_sample=False,
        temperature=1.0,
        top_k=None,
        top_p=None,
    )
    return eos, pad


def generate_batch(
    model: Any, tokenizer: Any, jobs: list[Job], eos_ids: set[int], pad_id: int
) -> BatchStreamer:
    """Run one static batch to completion: left-pad, generate, stream each row's deltas."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    width = max(len(j.prompt_ids) for j in jobs)
    input_ids = torch.full((len(jobs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(jobs), width), dtype=torch.long)
    for i, job in enumerate(jobs):
        n = len(job.prompt_ids)
        input_ids[i, width - n :] = torch.tensor(job.prompt_ids, dtype=torch.long)
        mask[i, width - n :] = 1
    streamer = BatchStreamer(jobs, tokenizer, eos_ids)
    sample = any(j.temperature > 0 for j in jobs)
    processors = LogitsProcessorList(
        [RowTemperature([j.temperature for j in jobs])] if sample else []
    )
    device = next(model.parameters()).device
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max(j.max_tokens for j in jobs),
            min_new_tokens=0,
            do_sample=sample,
            pad_token_id=pad_id,
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([RowStopping(jobs, width, eos_ids)]),
            logits_processor=processors,
        )
    return streamer


class Batcher:
    """Groups queued jobs into static batches and runs them one after another on one thread."""

    def __init__(
        self, model: Any, tokenizer: Any, max_batch_size: int = 16, window_s: float = 0.02
    ) -> None:
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
                await loop.run_in_executor(
                    self.executor,
                    generate_batch,
                    self.model,
                    self.tokenizer,
                    batch,
                    self.eos_ids,
                    self.pad_id,
                )
            except Exception as exc:  # every waiting client gets the error
                logger.exception("batch of %d failed", len(batch))
                for job in batch:
                    if job.finish_reason is None:
                        job.finish_reason = "error"
                        job.emit("error", f"{type(exc).__name__}: {exc}")


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
