"""LLMEngine: requests in, one scheduled forward pass per step, outputs out.

Construction: the checkpoint, tokenizer and model (engine/loading.py), the KV cache sized by its
byte budget, in one pool or two (engine/kv_layout.py, engine/kv_sizing.py; on CUDA the budget
--gpu-memory-utilization leaves after a memory profile, engine/memory_profile.py), then the block
manager, scheduler, grammar service and runner. A request is checked on the way in
(engine/request_checks.py); each sampled token is applied to its sequence and reported as a
RequestOutput (engine/step_output.py); the figures for /metrics come from engine/stats.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any, cast

import torch

from edgellm.config import EngineConfig
from edgellm.engine import request_checks
from edgellm.engine.cuda_graphs import cuda_graphs
from edgellm.engine.kv_layout import make_block_manager, plan_kv_cache
from edgellm.engine.kv_publisher import make_publisher
from edgellm.engine.loading import load
from edgellm.engine.memory_profile import measured_kv_budget
from edgellm.engine.output import CompletionOutput, RequestOutput, TextState
from edgellm.engine.runner import ModelRunner
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import FinishReason, Sequence, Status
from edgellm.engine.stats import engine_stats, kv_cache_info
from edgellm.engine.step_output import Logprob, append_token, crosses_long_rope, request_output
from edgellm.sampling import GrammarMasks, Sampler, SamplingParams
from edgellm.structured.grammar import GrammarService

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        loaded = load(config, self.device)
        self.checkpoint, self.model_config = loaded.checkpoint, loaded.model_config
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.model, self.kv_dtype = loaded.model, loaded.kv_dtype
        requested_len = loaded.requested_len
        mcfg = self.model_config

        measured = measured_kv_budget(self.model, config, self.device, self.kv_dtype, requested_len)
        layout = plan_kv_cache(
            self.model, config, self.device, self.kv_dtype, requested_len, measured
        )
        self.max_model_len = layout.max_model_len
        # KV-cache events: recorded by the block manager, published off this thread
        self.kv_publisher = make_publisher(config.kv_events)
        self.block_manager = make_block_manager(layout, config, self.kv_publisher is not None)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self._cache_key,
            policy=config.scheduling_policy,
        )
        # structured outputs: grammars compiled on their own thread, masks applied in the sampler
        self.grammars = (
            GrammarService(self.tokenizer.hf, mcfg.vocab_size, self.eos_token_ids)
            if self.tokenizer is not None
            else None
        )
        # GrammarMasks takes any Matcher; the service takes its own, which every sequence's matcher
        # is (add_request makes them with self.grammars.matcher)
        masks = cast("GrammarMasks | None", self.grammars)
        self.runner = ModelRunner(
            self.model,
            layout.num_blocks,
            config.block_size,
            self.kv_dtype,
            self.device,
            Sampler(masks),
            layout.num_window_blocks,
            cuda_graphs(config, self.max_model_len) if self.device.type == "cuda" else None,
        )
        if self.kv_dtype == torch.float8_e4m3fn:
            given = sum(attn.scales_known for attn in self.model.attention_layers())
            logger.info(
                "fp8 KV cache: scales for %d/%d layers from the checkpoint; the rest are computed "
                "from the first prefill",
                given,
                mcfg.num_layers,
            )
        self.seqs: dict[str, Sequence] = {}
        self.text: dict[str, TextState] = {}
        self.prompts: dict[str, str | None] = {}
        self._counter = itertools.count()
        self.num_steps = 0
        # request ids of the step in progress (None while it is being planned)
        self.step_request_ids: list[str] | None = []

    # --------------------------------------------------------------- requests
    def _cache_key(self, seq: Sequence) -> bytes:
        rotary = self.model.model.rotary
        if rotary.long_threshold is not None and seq.num_tokens > rotary.long_threshold:
            return b"long-rope"
        return b""

    def prepare(
        self, prompt: str | Seq[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """The prompt tokenized and the request checked (request_checks.prepare); ValueError on
        bad input."""
        return request_checks.prepare(
            self.tokenizer, prompt, params, self.max_model_len, self.model_config.vocab_size
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        want_prompt_logits: bool = False,
        grammar: Any = None,
        priority: int = 0,
    ) -> None:
        """grammar: the compiled grammar of params.structured_outputs (from grammar_future);
        compiled
        here, on the caller's thread, when not given. priority: lower runs sooner; anything but 0
        needs the priority scheduling policy (ValueError otherwise, as vLLM)."""
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_priority(priority)
        text, ids = self.prepare(prompt, params)
        seq = Sequence(
            request_id,
            ids,
            params,
            self.eos_token_ids,
            next(self._counter),
            want_prompt_logits,
            priority=priority,
        )
        if params.structured_outputs is not None:
            grammar = grammar if grammar is not None else self.grammar_future(params).result()
            seq.grammar = self._grammar_service().matcher(grammar)
        self.seqs[request_id] = seq
        self.text[request_id] = TextState(seq, self.tokenizer)
        self.prompts[request_id] = text
        self.scheduler.add(seq)

    def grammar_future(self, params: SamplingParams) -> Any:
        """A concurrent Future of the compiled grammar of params.structured_outputs (not None)."""
        spec = params.structured_outputs
        if spec is None:
            raise ValueError("these sampling params ask for no structured output")
        return self._grammar_service().compile_future(spec)

    def _grammar_service(self) -> GrammarService:
        if self.grammars is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        return self.grammars

    def validate_priority(self, priority: int) -> None:
        request_checks.check_priority(priority, self.config.scheduling_policy)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are free when this returns."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        return self._finalize(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Plan and run one step; returns an output for each request that advanced or finished.

        If it raises, `fail_step` finishes the requests this step held with an error."""
        self.step_request_ids = None  # unknown until the plan exists
        sched = self.scheduler.schedule()
        self.step_request_ids = [item.seq.request_id for item in sched.scheduled]
        if not sched:
            self._publish_kv_events()
            return []
        now = time.monotonic()
        for item in sched.scheduled:
            if item.seq.timing.first_scheduled is None:
                item.seq.timing.first_scheduled = now
        result = self.runner.execute(sched)
        self.num_steps += 1
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens, self._cache_key(seq))
            error = result.failed.get(seq.request_id)
            if error is not None:
                logger.error("request %s failed: %s", seq.request_id, error)
                # its KV may hold NaN: keep it out of the prefix cache and out of the next owner's
                # way
                self.block_manager.uncache(seq)
                bm = self.block_manager
                self.runner.zero_blocks(bm.exclusive_blocks(seq), bm.exclusive_window_blocks(seq))
                outputs.extend(self.fail_requests([seq.request_id], error))
                continue
            chunk_logits = result.prompt_logits.get(seq.request_id)
            if chunk_logits is not None:
                seq.prompt_logits.append(chunk_logits)
            token = result.sampled.get(seq.request_id)
            if token is None:
                continue
            if seq.want_prompt_logits:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                outputs.append(self._finalize(seq))
                continue
            outputs.append(self._append_token(seq, token, result.logprobs.get(seq.request_id), now))
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_publisher is not None:
            events = self.block_manager.take_events()
            if events:
                self.kv_publisher.publish(time.time(), events)

    def close(self) -> None:
        """Flush and stop the KV event publisher (the engine itself holds nothing else to close)."""
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.close()

    def _append_token(
        self, seq: Sequence, token: int, logprob: Logprob | None, now: float
    ) -> RequestOutput:
        state = self.text[seq.request_id]
        reason = append_token(seq, token, logprob, now, state, self.max_model_len)
        if reason is None:
            if crosses_long_rope(seq, self.model.model.rotary.long_threshold):
                self.scheduler.recompute(seq)
            return self._output(seq, [token])
        self.scheduler.finish(seq, reason)
        return self._finalize(seq, [token])

    def _output(self, seq: Sequence, delta_ids: list[int]) -> RequestOutput:
        state = self.text[seq.request_id]
        return request_output(seq, state, self.prompts.get(seq.request_id), delta_ids)

    def _finalize(self, seq: Sequence, delta_ids: list[int] | None = None) -> RequestOutput:
        seq.timing.finished = time.monotonic()
        out = self._output(seq, delta_ids or [])
        self.seqs.pop(seq.request_id, None)
        self.text.pop(seq.request_id, None)
        self.prompts.pop(seq.request_id, None)
        return out

    def fail_requests(self, request_ids: Seq[str], message: str) -> list[RequestOutput]:
        """Finish these requests with an error (e.g. the step that held them raised)."""
        outs = []
        for rid in request_ids:
            seq = self.seqs.get(rid)
            if seq is None or seq.is_finished:
                continue
            seq.error = message
            self.scheduler.finish(seq, FinishReason.ERROR)
            outs.append(self._finalize(seq))
        return outs

    def fail_step(self, message: str) -> list[RequestOutput]:
        """The last step raised: fail the requests it held and keep the others.

        If the planner itself raised, which requests it touched is unknown, so every
        unfinished request fails (the engine's state is then rebuilt from nothing)."""
        ids = self.step_request_ids
        if ids is None:
            ids = [
                s.request_id for s in list(self.scheduler.running) + list(self.scheduler.waiting)
            ]
        self.step_request_ids = []
        return self.fail_requests(ids, message)

    def running_request_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduler.running]

    def cache_info(self) -> dict[str, str]:
        """The KV cache's configuration as vLLM's cache_config_info labels (values are str())."""
        return kv_cache_info(self.config, self.block_manager)

    def stats(self) -> dict[str, float]:
        return engine_stats(self.scheduler, self.block_manager, self.num_steps)


__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "Status"]
