"""LLMEngine: requests in, one scheduled forward pass per step, outputs out.

Construction: the checkpoint, tokenizer and model (engine/loading.py), the KV cache sized by its
byte budget, in one pool or two (engine/kv_layout.py, engine/kv_sizing.py; on CUDA the budget
--gpu-memory-utilization leaves after a memory profile, engine/memory_profile.py), then the block
manager, scheduler, grammar service and runner.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any, cast

import torch

from edgellm.config import EngineConfig
from edgellm.engine import memory_profile
from edgellm.engine.kv_layout import make_block_manager, plan_kv_cache
from edgellm.engine.kv_publisher import make_publisher
from edgellm.engine.loading import load
from edgellm.engine.output import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TextState,
    check_finish,
)
from edgellm.engine.runner import ModelRunner
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import FinishReason, Sequence, Status
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

        measured = None
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            mem = memory_profile.measure(
                self.device,
                lambda: memory_profile.profile_step(
                    self.model,
                    config.block_size,
                    self.kv_dtype,
                    self.device,
                    min(config.max_num_batched_tokens, requested_len),
                    config.max_num_seqs,
                ),
            )
            measured = memory_profile.kv_budget(mem, config.gpu_memory_utilization)
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

    def tokenize_prompt(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        return None, ids

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
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt(ids, params)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
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
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but priority scheduling is not enabled "
                f"(start the engine with scheduling_policy='priority')"
            )

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model accepts at most "
                f"{self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len}, one position is kept for the output)"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of the vocabulary (size {vocab})")

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
        self,
        seq: Sequence,
        token: int,
        logprob: tuple[float, list[tuple[int, float]]] | None,
        now: float,
    ) -> RequestOutput:
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.timing.first_token is None:
            seq.timing.first_token = now
        state = self.text[seq.request_id]
        reason = check_finish(seq, token, self.max_model_len)
        # a stop token (EOS, stop_token_ids) ends the text without its own text (as vLLM does),
        # which matters once special tokens are decoded (skip_special_tokens=False)
        stopped_by_token = reason is FinishReason.STOP and not seq.params.include_stop_str_in_output
        stop_str = None if stopped_by_token else state.add_token(token)
        if seq.grammar is not None:
            if not seq.grammar.accept(token):
                seq.error = (
                    f"token {token} is not allowed by the request's structured-output grammar"
                )
                self.scheduler.finish(seq, FinishReason.ERROR)
                return self._finalize(seq, [token])
            if seq.grammar.is_terminated and reason is None:
                reason = FinishReason.STOP
        if stop_str is not None:
            seq.stop_reason = stop_str
            reason = FinishReason.STOP
        if reason is None:
            threshold = self.model.model.rotary.long_threshold
            if (
                threshold is not None
                and seq.num_tokens == threshold + 1
                and seq.num_computed_tokens == threshold
            ):
                # longrope: crossing the pretraining length switches every position to the long
                # factors, so the cached K (rotated with the short ones) is recomputed, as
                # transformers does for Phi-3.
                self.scheduler.recompute(seq)
            return self._output(seq, [token])
        state.finish(stop_str, seq.params.include_stop_str_in_output)
        self.scheduler.finish(seq, reason)
        return self._finalize(seq, [token])

    def _output(self, seq: Sequence, delta_ids: list[int]) -> RequestOutput:
        state = self.text[seq.request_id]
        delta = state.release(seq.is_finished)
        completion = CompletionOutput(
            index=0,
            text=state.text[: state.released],
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )
        t = seq.timing
        metrics = RequestMetrics(
            t.arrival,
            t.first_scheduled,
            t.first_token,
            t.finished,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            len(seq.output_token_ids),
            seq.num_preemptions,
        )
        logits = (
            torch.cat(seq.prompt_logits) if seq.is_finished and seq.want_prompt_logits else None
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompts.get(seq.request_id),
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            delta_text=delta,
            delta_token_ids=delta_ids,
            metrics=metrics,
            prompt_logits=logits,
            error=seq.error,
        )

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
        return {
            "block_size": str(self.config.block_size),
            "cache_dtype": self.config.kv_cache_dtype,
            "enable_prefix_caching": str(bool(self.config.enable_prefix_caching)),
            "num_gpu_blocks": str(self.block_manager.num_blocks),
        }

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_held": bm.num_held_blocks,
            "kv_usage": bm.num_held_blocks / bm.num_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        }


__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "Status"]
