"""The offline API, shaped like vLLM's: LLM(...).generate / chat / prompt_logits."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm import tqdm

from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.output import CompletionOutput, RequestOutput
from edgellm.sampling import SamplingParams
from edgellm.tools.families import check_parser_name, choose_parser
from edgellm.tools.spec import (
    ToolPlan,
    parse_output,
    plan,
    template_takes_tools,
    with_generic_prompt,
)

# a text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...} /
# {"prompt_token_ids": ...})
Prompt = str | Seq[int] | dict[str, Any]


def _one_prompt(p: Any) -> str | list[int]:
    """A prompt as the engine takes it (text or token ids); a TypeError names anything else."""
    if isinstance(p, dict):
        keys = set(p) - {"multi_modal_data", "mm_processor_kwargs", "cache_salt"}
        if keys == {"prompt_token_ids"}:
            p = p["prompt_token_ids"]
        elif keys == {"prompt"}:
            p = p["prompt"]
        else:
            raise TypeError(
                f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids', got keys {sorted(p)}"
            )
    if isinstance(p, str):
        return p
    if isinstance(p, Seq) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise TypeError(f"a prompt is a string, a list of token ids or a dict; got {type(p).__name__}")


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [_one_prompt(items)]  # one prompt given as token ids
    return [_one_prompt(p) for p in items]


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """n > 1 runs as n sequences (seeded ones get seed, seed+1, ...)."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def _parse_calls(tool_plan: ToolPlan, completion: CompletionOutput) -> None:
    _, calls, completion.finish_reason = parse_output(
        tool_plan, completion.text, completion.finish_reason or "stop"
    )
    completion.tool_calls = calls or None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int | None = None,
        max_model_len: int | None = None,
        tool_call_parser: str | None = None,
        **kwargs: Any,
    ) -> None:
        """`tool_call_parser`: the format of the model's tool calls (a tools.families.PARSERS name);
        None: the one its chat template asks for, else hermes. The other arguments are
        EngineConfig's."""
        self.tool_call_parser = (
            None if tool_call_parser is None else check_parser_name(tool_call_parser)
        )
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            **kwargs,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, tool_call_parser: str | None = None) -> LLM:
        llm = cls.__new__(cls)
        llm.tool_call_parser = (
            None if tool_call_parser is None else check_parser_name(tool_call_parser)
        )
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuously batched); outputs in prompt order.

        priority: one per prompt, as vLLM's (lower runs sooner); needs scheduling_policy="priority"
        unless every value is 0."""
        items = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError("give one SamplingParams, or one per prompt")
        priorities = [0] * len(items) if priority is None else list(priority)
        if len(priorities) != len(items):
            raise ValueError("give one priority per prompt")
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt, params, prio in zip(items, params_list, priorities):
                base = str(next(self._ids))
                ids = []
                for j, p in enumerate(expand_n(params)):
                    rid = f"{base}-{j}"
                    self.engine.add_request(rid, prompt, p, priority=prio)
                    added.append(rid)
                    ids.append(rid)
                groups.append(ids)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finals = self._run(added, use_tqdm)
        results = []
        for ids in groups:
            first = finals[ids[0]]
            outputs = []
            for j, rid in enumerate(ids):
                completion = finals[rid].outputs[0]
                completion.index = j
                outputs.append(completion)
            results.append(
                dataclasses.replace(first, request_id=ids[0].rsplit("-", 1)[0], outputs=outputs)
            )
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        pending = set(request_ids)
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc="generate", disable=not use_tqdm)
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finals[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        finally:
            bar.close()
            for rid in pending:
                self.engine.abort_request(rid)
        return finals

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Chat completions. With tools (OpenAI's shapes; see edgellm/tools/spec.py) each choice's
        tool_calls holds the parsed calls (tool_choice "auto": in the format of `tool_call_parser`)
        and its finish_reason is "tool_calls" when it made any; "required" and a named tool_choice
        are grammar-constrained."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tool_plan = plan(tools, tool_choice, parallel_tool_calls)
        if tool_plan is not None and tool_plan.mode == "none":
            tool_plan = None
        kwargs: dict[str, Any] = {}
        if tool_plan is not None:
            tool_plan = dataclasses.replace(
                tool_plan, parser_name=choose_parser(self.tool_call_parser, tok.hf.chat_template)
            )
            if template_takes_tools(tok.hf.chat_template):
                kwargs["tools"] = tool_plan.tools
            else:
                conversations = [
                    with_generic_prompt(list(c), tool_plan.tools) for c in conversations
                ]  # type: ignore[arg-type]
        # type: ignore[arg-type]
        prompts = [tok.encode_chat(list(c), add_generation_prompt, **kwargs) for c in conversations]
        if tool_plan is not None:
            base = [
                tool_plan.sampling(p)
                for p in (
                    sampling_params
                    if isinstance(sampling_params, Seq)
                    else [sampling_params or SamplingParams()] * len(prompts)
                )
            ]
            constraint = tool_plan.constraint()
            if constraint is not None:
                if any(p.structured_outputs is not None for p in base):
                    raise ValueError(
                        f"tool_choice {tool_plan.mode!r} constrains the output itself; it cannot "
                        "be combined with structured_outputs"
                    )
                base = [dataclasses.replace(p, structured_outputs=constraint) for p in base]
            sampling_params = base
        results = self.generate(prompts, sampling_params, use_tqdm)
        if tool_plan is not None:
            for result in results:
                for completion in result.outputs:
                    _parse_calls(tool_plan, completion)
        return results

    def prompt_logits(self, token_id_lists: Seq[Seq[int]]) -> list[torch.Tensor]:
        """float32 logits [len(prompt), vocab] for every position of every prompt."""
        ids = []
        for prompt in token_id_lists:
            rid = f"logits-{next(self._ids)}"
            self.engine.add_request(
                rid,
                list(prompt),
                SamplingParams(max_tokens=1, temperature=0.0),
                want_prompt_logits=True,
            )
            ids.append(rid)
        finals = self._run(ids, use_tqdm=False)
        return [finals[rid].prompt_logits for rid in ids]  # type: ignore[misc]
