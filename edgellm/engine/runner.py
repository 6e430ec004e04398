"""Runs one scheduled step: flatten it into tensors, run the model once for all
requests, project the needed rows to logits and sample."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from edgellm.batch import AttentionMetadata, ForwardBatch
from edgellm.engine.cuda_graphs import DecodeGraphs
from edgellm.engine.scheduler import SchedulerOutput
from edgellm.models.decoder import CausalLM, DecoderLayer
from edgellm.sampling import Sampler, SampleResult

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(
    model: CausalLM, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """Bytes of one block of K and V over `num_layers` layers (default: all)."""
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass
class StepResult:
    # request_id -> sampled token (only sequences whose chunk reached their last token)
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    # request_id -> float32 logits [chunk_len, vocab] (prompt_logits mode)
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # request_id -> why it cannot go on (NaN/+inf logits); such rows are not sampled
    failed: dict[str, str] = field(default_factory=dict)


NAN_ERROR = "the model produced non-finite logits (NaN or +inf) for this request"


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of [B, V] logits holding a NaN or +inf (-inf is a legitimately impossible token)."""
    top = logits.amax(-1)  # one pass: a row's max is NaN if it holds a NaN, +inf if it holds +inf
    bad = torch.isnan(top) | torch.isposinf(top)
    if not bool(bad.any()):
        return []
    return bad.nonzero().flatten().tolist()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        sampler: Sampler | None = None,
        window_blocks: int | None = None,
        graphs: Callable[[ModelRunner], DecodeGraphs] | None = None,
    ) -> None:
        """window_blocks: the sliding-window layers' own pool (engine/window_blocks.py) of this
        many blocks, filled from Sequence.window_table; None: every layer uses block_table.
        graphs: makes the captured decode steps (engine/cuda_graphs.py) for this runner; None:
        every step eager."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        cfg = model.config
        self.kv_caches = []
        self.windowed: list[bool] = []  # per layer: its cache is the window pool's
        # One block past the allocator's range stays zero: block tables are padded with it, so a
        # batched read past a sequence's end (masked, but 0 x NaN is NaN) never sees another
        # request's KV.
        self.null_block = num_blocks
        self.window_null = window_blocks  # the window pool's zero block (FREED entries read it)
        for layer in model.model.layers:
            sa = cast(DecoderLayer, layer).self_attn  # an nn.ModuleList's items are typed Module
            windowed = window_blocks is not None and sa.attn.sliding_window is not None
            pages = window_blocks if window_blocks is not None and windowed else num_blocks
            cache = torch.zeros(
                2,
                pages + 1,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=kv_dtype,
                device=self.device,
            )
            k_scale, v_scale = float(sa.get_buffer("k_scale")), float(sa.get_buffer("v_scale"))
            given = (
                kv_dtype == torch.float8_e4m3fn
                and not math.isnan(k_scale)
                and not math.isnan(v_scale)
            )  # NaN: the checkpoint gave none
            sa.attn.bind_cache(cache, k_scale if given else None, v_scale if given else None)
            self.kv_caches.append(cache)
            self.windowed.append(windowed)
        self.sampler = sampler or Sampler()
        self.needs_seq_lens = model.model.rotary.long_threshold is not None
        self.graphs = graphs(self) if graphs is not None else None

    def build_batch(self, sched: SchedulerOutput) -> tuple[ForwardBatch, list[int]]:
        """Flatten the step. Returns the batch and, per scheduled sequence, its logits row count."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        window_slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_rows: list[int] = []
        rows_per_seq: list[int] = []
        total_lens: list[int] = []
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if self.window_null is not None:
                wt = seq.window_table
                window_slots.extend(wt[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            if self.needs_seq_lens:
                total_lens.extend([seq.num_tokens] * n)
            if seq.want_prompt_logits:
                logits_rows.extend(range(qsl[-2], qsl[-1]))
                rows_per_seq.append(n)
            elif item.samples:
                logits_rows.append(qsl[-1] - 1)
                rows_per_seq.append(1)
            else:
                rows_per_seq.append(0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._tables(sched, 0, self.null_block).to(dev),
            seq_lens=seq_lens,
            query_start_loc=qsl,
            num_decodes=sched.num_decodes,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(item.num_new_tokens for item in sched.scheduled),
            max_seq_len=max(seq_lens),
        )
        if self.window_null is not None:
            meta.window = replace(
                meta,
                slot_mapping=torch.tensor(window_slots, dtype=torch.int64, device=dev),
                block_tables=self._tables(sched, 1, self.window_null).to(dev),
                step_cache={},
            )
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attn=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            seq_total_lens=torch.tensor(total_lens, dtype=torch.int64, device=dev)
            if total_lens
            else None,
        )
        return batch, rows_per_seq

    @staticmethod
    def _tables(sched: SchedulerOutput, group: int, null: int) -> torch.Tensor:
        """[B, max blocks] int32 of one pool's tables; padding and FREED entries read `null`."""
        rows = [item.seq.block_tables[group] for item in sched.scheduled]
        tables = torch.full((len(rows), max(map(len, rows))), null, dtype=torch.int32)
        for i, t in enumerate(rows):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        if group:
            tables.masked_fill_(tables < 0, null)
        return tables

    @torch.inference_mode()
    def zero_blocks(self, block_ids: list[int], window_ids: list[int] | None = None) -> None:
        """Clear these blocks' K and V (a failed request's NaN must not outlive it in a reused
        block); window_ids: the window pool's."""
        pools = [
            torch.tensor(ids, dtype=torch.int64, device=self.device) if ids else None
            for ids in (block_ids, window_ids)
        ]
        for cache, windowed in zip(self.kv_caches, self.windowed):
            idx = pools[windowed]
            if idx is not None:
                cache.index_fill_(1, idx, 0)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        batch, rows_per_seq = self.build_batch(sched)
        if self.graphs is not None and self.graphs.eligible(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model(batch)
        result = StepResult()
        if batch.logits_indices.numel() == 0:
            return result
        argmax_only: list[bool] = []
        sampling: list[bool] = []  # rows whose logits only feed the sampler at a temperature
        allowed: dict[int, torch.Tensor] = {}  # greedy grammar rows: the head masks them itself
        # grammar masks the logits head applies itself (greedy rows), where it can
        head_masks = self.sampler.grammar
        if head_masks is not None and not self.model.supports_masked_argmax:
            head_masks = None
        for item, count in zip(sched.scheduled, rows_per_seq):
            if count:
                seq = item.seq
                ok = not seq.want_prompt_logits and seq.params.argmax_only
                if (
                    head_masks is not None
                    and seq.grammar is not None
                    and item.samples
                    and seq.params.argmax_under_grammar
                ):
                    allowed[len(argmax_only)] = head_masks.allowed(seq.grammar)
                argmax_only.extend([ok] * count)
                sampling.extend([not seq.want_prompt_logits and seq.params.sampling_only] * count)
        logits = self.model.compute_logits(
            hidden[batch.logits_indices], argmax_only, allowed or None, sampling
        )
        sample_rows: list[int] = []
        sample_seqs = []
        row = 0
        for item, count in zip(sched.scheduled, rows_per_seq):
            if count == 0:
                continue
            seq = item.seq
            if seq.want_prompt_logits:
                result.prompt_logits[seq.request_id] = logits[row : row + count].cpu()
            if item.samples:
                sample_rows.append(row + count - 1)
                sample_seqs.append(seq)
            row += count
        if sample_seqs:
            # every row samples (a decode step; sample_rows rise, so equal length means all rows):
            # the logits as they are, not a copy of [B, V]
            rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            # prompt_logits mode hands the raw logits back, whatever they hold
            bad = [i for i in nonfinite_rows(rows) if not sample_seqs[i].want_prompt_logits]
            if bad:
                # One request's NaN (a bad prompt, an overflow) fails that request only.
                for i in bad:
                    result.failed[sample_seqs[i].request_id] = NAN_ERROR
                dropped = set(bad)
                keep = [i for i in range(len(sample_seqs)) if i not in dropped]
                rows, sample_seqs = rows[keep], [sample_seqs[i] for i in keep]
                sample_rows = [sample_rows[i] for i in keep]
        if sample_seqs:
            premasked = [r in allowed for r in sample_rows]  # the head applied their grammar masks
            sampled: SampleResult = self.sampler(rows, sample_seqs, premasked)
            for seq, tok, lp in zip(sample_seqs, sampled.token_ids, sampled.logprobs):
                result.sampled[seq.request_id] = tok
                if lp is not None:
                    result.logprobs[seq.request_id] = lp
        return result
