"""One sampled token applied to its sequence, and the RequestOutput a sequence reports.

`append_token` adds the token (and its logprobs) to the sequence and its text, and decides
whether the sequence finishes: by the token (EOS, stop ids, max tokens, max_model_len), by a
stop string in the text, by the structured-output grammar ending, or with an error when the
grammar refuses the token. `crosses_long_rope` says when a longrope model's cached K must be
recomputed. `request_output` is the RequestOutput of a sequence as it stands: the text released
so far, its tokens, logprobs, finish reason, metrics and (once finished) prompt logits.
"""

from __future__ import annotations

import torch

from edgellm.engine.output import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TextState,
    check_finish,
)
from edgellm.engine.sequence import FinishReason, Sequence

Logprob = tuple[float, list[tuple[int, float]]]


def append_token(
    seq: Sequence,
    token: int,
    logprob: Logprob | None,
    now: float,
    state: TextState,
    max_model_len: int,
) -> FinishReason | None:
    """Append `token` to `seq` and to its text `state`; returns why the sequence finishes now, or
    None while it goes on. FinishReason.ERROR: the grammar refused the token (seq.error says why,
    the text is left as it was; seq.error_param is set when no token at all could have continued
    the grammar: the request's constraint is at fault, not the sampler). Any other reason: the
    text is complete (cut at the stop string, or flushed)."""
    seq.append_token(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    if seq.timing.first_token is None:
        seq.timing.first_token = now
    reason = check_finish(seq, token, max_model_len)
    # a stop token (EOS, stop_token_ids) ends the text without its own text (as vLLM does),
    # which matters once special tokens are decoded (skip_special_tokens=False)
    stopped_by_token = reason is FinishReason.STOP and not seq.params.include_stop_str_in_output
    stop_str = None if stopped_by_token else state.add_token(token)
    if seq.grammar is not None:
        if not seq.grammar.accept(token):
            if seq.grammar.allows_nothing():  # the constraint, not the sampler, is at fault
                spec = seq.params.structured_outputs
                seq.error_param = spec.source if spec is not None else "structured_outputs"
                seq.error = (
                    f"{seq.error_param}: no token of this model's vocabulary can continue the "
                    f"constraint after {len(seq.output_token_ids) - 1} output tokens"
                )
            else:
                seq.error = (
                    f"token {token} is not allowed by the request's structured-output grammar"
                )
            return FinishReason.ERROR
        if seq.grammar.is_terminated and reason is None:
            reason = FinishReason.STOP
    if stop_str is not None:
        seq.stop_reason = stop_str
        reason = FinishReason.STOP
    if reason is None:
        return None
    state.finish(stop_str, seq.params.include_stop_str_in_output)
    return reason


def crosses_long_rope(seq: Sequence, long_threshold: int | None) -> bool:
    """The sequence just crossed a longrope model's pretraining length: every position switches
    to the long factors, so the cached K (rotated with the short ones) must be recomputed, as
    transformers does for Phi-3."""
    return (
        long_threshold is not None
        and seq.num_tokens == long_threshold + 1
        and seq.num_computed_tokens == long_threshold
    )


def request_output(
    seq: Sequence, state: TextState, prompt: str | None, delta_ids: list[int]
) -> RequestOutput:
    """The sequence's output now; releases the text that is safe to hand out."""
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
    logits = torch.cat(seq.prompt_logits) if seq.is_finished and seq.want_prompt_logits else None
    return RequestOutput(
        request_id=seq.request_id,
        prompt=prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.is_finished,
        delta_text=delta,
        delta_token_ids=delta_ids,
        metrics=metrics,
        prompt_logits=logits,
        error=seq.error,
        error_param=seq.error_param,
    )
