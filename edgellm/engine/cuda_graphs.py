"""CUDA graphs for decode steps (as vLLM and nano-vllm capture them): a small model's decode step
on a GPU is a few hundred kernel launches of microseconds each, so launching them costs more than
running them; a captured graph replays them all in one launch.

A step that is all decodes (one new token per sequence), with at most the largest bucket's
sequences, runs as the graph of the smallest bucket (1, 2, 4, 8, then
multiples of 8 up to max_num_seqs) that holds it: its inputs are copied into static buffers, the
rows past the step's padded (token 0 at position 0, KV slot -1: the write skips it, block table
all the null block, context length 1; with a sliding-window pool, its slots and tables
likewise), the graph replayed, and the first rows of its static output
returned. Each bucket is captured the first time a step needs it, so whatever the first prefill
settles (fp8 KV scales, Triton's compiled kernels) is in place. Everything a captured step reads
from the host is fixed per bucket: the attention sees max_seq_len = the table capacity
(ceil(max_model_len / block_size) blocks), so the split-K grid is the same every replay and
splits past a sequence's end are empty. Any other step runs eagerly, and so does every step
after a capture that failed (logged once, with the error).

The captured step's host-side lists of lengths refuse to be read (`HostLengths`): only the
tensors are the step's. The capture itself is a backend (`GraphBackend`): `CudaGraphBackend` on
CUDA; `RerunBackend` replays by running the captured function again with every host read of a
tensor refused, which checks the same discipline on CPU (tests, and gpu_check's dry run).
ModelRunner takes a maker of its DecodeGraphs (`cuda_graphs`: on CUDA unless enforce_eager).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from edgellm.batch import AttentionMetadata, ForwardBatch

if TYPE_CHECKING:
    from edgellm.config import EngineConfig
    from edgellm.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Capture fn (which reads only static tensors); (replay, the static output fn made)."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, all buckets in one memory pool; a warm-up run on a side stream first
    (lazy initialisations and autotuning must not happen inside a capture)."""

    def __init__(self) -> None:
        self.pool: Any = None  # the first graph's memory pool handle, shared by the others

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph.replay, out


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Within: reading a tensor's value into Python (item, tolist, bool, int, float) raises, as a
    captured graph could never see it change."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a host read of a tensor inside a captured step")

    names = ("item", "tolist", "__bool__", "__int__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class RerunBackend:
    """The graphs' discipline checked without CUDA: captures by running fn under no_host_reads,
    replays by running it again into the same output tensor (fn reads only the static buffers, so
    that is what a graph replay computes). Counts captures and replays."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        self.captures += 1  # counted when it fails too
        with no_host_reads():
            out = fn()

        def replay() -> None:
            self.replays += 1
            with no_host_reads():
                out.copy_(fn())

        return replay, out


class HostLengths(list):
    """The per-sequence host lists of a captured step's AttentionMetadata (seq_lens,
    query_start_loc): a graph replays kernels, so it cannot follow them; reading one raises, and
    the capture fails (its steps then run eagerly)."""

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError(
            "a captured step read the host-side lengths (seq_lens, query_start_loc)"
        )

    __getitem__ = __iter__ = __len__ = __contains__ = _refuse


def buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to max_num_seqs (which is always the last)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    """Captured decode steps of one model (see the module docstring)."""

    def __init__(
        self,
        model: Callable[[ForwardBatch], torch.Tensor],
        backend: GraphBackend,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        null_block: int,
        device: torch.device,
        with_total_lens: bool = False,
        window_null: int | None = None,
    ) -> None:
        """max_blocks: the block tables' capacity (ceil(max_model_len / block_size));
        null_block: the zero block padding reads; with_total_lens: the model reads
        ForwardBatch.seq_total_lens (longrope); window_null: the sliding-window pool's zero block
        when the model has that pool (engine/window_blocks.py), else None."""
        self.model = model
        self.backend = backend
        self.buckets = buckets(max_num_seqs)
        self.max_blocks = max_blocks
        self.capacity = max_blocks * block_size
        self.null_block = null_block
        top = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(top, dtype=i64, device=device)
        self.positions = torch.zeros(top, dtype=i64, device=device)
        self.slots = torch.full((top,), -1, dtype=i64, device=device)
        self.tables = torch.full((top, max_blocks), null_block, dtype=i32, device=device)
        self.seq_lens = torch.ones(top, dtype=i32, device=device)
        self.query_start = torch.arange(top + 1, dtype=i32, device=device)
        self.logits_rows = torch.arange(top, dtype=i64, device=device)
        self.total_lens = torch.ones(top, dtype=i64, device=device) if with_total_lens else None
        self.window_null = window_null
        # the window pool's (slots, tables), as the fields above
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None
        if window_null is not None:
            self.window = (
                torch.full((top,), -1, dtype=i64, device=device),
                torch.full((top, max_blocks), window_null, dtype=i32, device=device),
            )
        self.graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.disabled: str | None = None  # why a capture failed: every step eager from then on

    def eligible(self, batch: ForwardBatch) -> bool:
        """Whether this step can run as a graph: all decodes, and a bucket holds it."""
        meta = batch.attn
        rows = len(meta.seq_lens)
        return (
            self.disabled is None
            and 0 < rows <= self.buckets[-1]
            and meta.num_decodes == rows
            and batch.input_ids.numel() == rows
            and (meta.window is None) == (self.window_null is None)
            and meta.block_tables.shape[1] <= self.max_blocks
            and (meta.window is None or meta.window.block_tables.shape[1] <= self.max_blocks)
            and (batch.seq_total_lens is None) == (self.total_lens is None)
        )

    def _static_batch(self, size: int) -> ForwardBatch:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            seq_lens=HostLengths(),
            query_start_loc=HostLengths(),
            num_decodes=size,
            seq_lens_tensor=self.seq_lens[:size],
            query_start_loc_tensor=self.query_start[: size + 1],
            max_query_len=1,
            max_seq_len=self.capacity,
        )
        if self.window is not None:
            slots, tables = self.window
            meta.window = replace(
                meta, slot_mapping=slots[:size], block_tables=tables[:size], step_cache={}
            )
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            attn=meta,
            logits_indices=self.logits_rows[:size],
            seq_total_lens=None if self.total_lens is None else self.total_lens[:size],
        )

    def _fill(self, batch: ForwardBatch, size: int) -> None:
        meta, rows = batch.attn, batch.input_ids.numel()
        width = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.input_ids[rows:size].zero_()
        self.positions[:rows].copy_(batch.positions)
        self.positions[rows:size].zero_()
        self.slots[:rows].copy_(meta.slot_mapping)
        self.slots[rows:size].fill_(-1)
        self.tables[:size].fill_(self.null_block)
        self.tables[:rows, :width].copy_(meta.block_tables)
        self.seq_lens[:rows].copy_(meta.seq_lens_tensor)
        self.seq_lens[rows:size].fill_(1)
        if self.window is not None and meta.window is not None and self.window_null is not None:
            slots, tables = self.window
            slots[:rows].copy_(meta.window.slot_mapping)
            slots[rows:size].fill_(-1)
            tables[:size].fill_(self.window_null)
            tables[:rows, : meta.window.block_tables.shape[1]].copy_(meta.window.block_tables)
        if self.total_lens is not None and batch.seq_total_lens is not None:
            self.total_lens[:rows].copy_(batch.seq_total_lens)
            self.total_lens[rows:size].fill_(1)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's hidden states [rows, hidden] for an eligible step, by a graph replay."""
        rows = batch.input_ids.numel()
        size = next(b for b in self.buckets if b >= rows)
        self._fill(batch, size)
        if size not in self.graphs:
            logger.info("capturing the decode graph for %d sequences", size)
            try:
                self.graphs[size] = self.backend.capture(
                    lambda: self.model(self._static_batch(size))
                )
            except Exception as exc:  # noqa: BLE001  (the step still runs, eagerly)
                self.disabled = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "CUDA graph capture failed, decode steps run eagerly: %s", self.disabled
                )
                return self.model(batch)
        replay, out = self.graphs[size]
        replay()
        return out[:rows]


def cuda_graphs(
    config: EngineConfig, max_model_len: int
) -> Callable[[ModelRunner], DecodeGraphs] | None:
    """What LLMEngine hands its CUDA ModelRunner: a maker of its DecodeGraphs on
    CudaGraphBackend, or None (every step eager) with config.enforce_eager."""
    if config.enforce_eager:
        return None
    max_blocks = -(-max_model_len // config.block_size)
    logger.info("decode steps as CUDA graphs, up to %d sequences", config.max_num_seqs)
    return lambda runner: DecodeGraphs(
        runner.model,
        CudaGraphBackend(),
        config.max_num_seqs,
        max_blocks,
        config.block_size,
        runner.null_block,
        runner.device,
        runner.needs_seq_lens,
        runner.window_null,
    )
