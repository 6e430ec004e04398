"""ModelRunner (edgellm/engine/runner.py) on its own, driven with hand-built steps: how a step is
flattened (token ids, positions, KV slots, block tables padded with the null block, the logits
rows), what execute returns (sampled tokens, prompt logits equal to transformers', a non-finite
row failing its request alone), the KV cache's bytes per block, and zero_blocks."""

from __future__ import annotations

import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.runner import NAN_ERROR, kv_cache_bytes_per_block, nonfinite_rows
from edgellm.engine.scheduler import ScheduledSeq, SchedulerOutput
from edgellm.engine.sequence import Sequence
from edgellm.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, hf = tiny_dir("llama")
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=1 << 20, max_model_len=128,
                                    cpu_quant="exact", enable_prefix_caching=False))
    return engine, hf


def _seq(rid: str, prompt: list[int], computed: int, table: list[int], outputs: list[int] = (),
         prompt_logits: bool = False) -> Sequence:
    seq = Sequence(rid, prompt, GREEDY, [], 0, want_prompt_logits=prompt_logits)
    for t in outputs:
        seq.append_token(t)
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _mixed_step(vocab: int) -> SchedulerOutput:
    decode = _seq("decode", _ids(20, 1, vocab), 20, [3, 5], outputs=[9])  # its 21st token
    chunk = _seq("chunk", _ids(40, 2, vocab), 16, [7, 2, 9])  # 10 of 24 prompt tokens left
    whole = _seq("whole", _ids(5, 3, vocab), 0, [11], prompt_logits=True)
    return SchedulerOutput([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 10), ScheduledSeq(whole, 5)])


def test_a_mixed_step_is_flattened_in_order(tiny):
    engine, _ = tiny
    runner = engine.runner
    sched = _mixed_step(engine.model.config.vocab_size)
    decode, chunk, whole = (item.seq for item in sched.scheduled)
    batch, rows = runner.build_batch(sched)
    meta = batch.attn
    assert batch.input_ids.tolist() == decode.token_ids[20:21] + chunk.token_ids[16:26] + whole.token_ids
    assert batch.positions.tolist() == [20, *range(16, 26), *range(5)]
    # slot = block_table[pos // 16] * 16 + pos % 16
    assert meta.slot_mapping.tolist() == [5 * 16 + 4, *(2 * 16 + p for p in range(10)), *(11 * 16 + p for p in range(5))]
    null = runner.null_block
    assert meta.block_tables.tolist() == [[3, 5, null], [7, 2, 9], [11, null, null]]
    assert meta.seq_lens == [21, 26, 5] and meta.query_start_loc == [0, 1, 11, 16]
    assert meta.num_decodes == 1 and meta.max_query_len == 10 and meta.max_seq_len == 26
    # the decode samples from its one row; the mid-prompt chunk needs no logits; the prompt-logits
    # request needs every row of its chunk
    assert batch.logits_indices.tolist() == [0, *range(11, 16)]
    assert rows == [1, 0, 5]


def test_execute_samples_and_returns_transformers_prompt_logits(tiny):
    engine, hf = tiny
    vocab = engine.model.config.vocab_size
    prompt = _ids(13, 4, vocab)
    step = SchedulerOutput([ScheduledSeq(_seq("p", prompt, 0, [1], prompt_logits=True), 13)])
    result = engine.runner.execute(step)
    logits = result.prompt_logits["p"]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    assert logits.shape == (13, vocab)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert result.sampled["p"] == int(want[-1].argmax()) and not result.failed


def test_a_non_finite_row_fails_its_request_only(tiny, monkeypatch):
    engine, _ = tiny
    runner = engine.runner
    vocab = engine.model.config.vocab_size
    seqs = [_seq(f"r{i}", _ids(6, 10 + i, vocab), 0, [20 + i]) for i in range(3)]
    original = runner.model.compute_logits

    def poisoned(*args, **kwargs):
        logits = original(*args, **kwargs).clone()
        logits[1, 7] = float("nan")
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    result = runner.execute(SchedulerOutput([ScheduledSeq(s, 6) for s in seqs]))
    assert result.failed == {"r1": NAN_ERROR}
    assert set(result.sampled) == {"r0", "r2"}


def test_nonfinite_rows_flags_nan_and_positive_infinity_only():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = float("-inf")  # an impossible token is legitimate
    logits[1, 0] = float("nan")
    logits[3, 10] = float("inf")
    assert nonfinite_rows(logits) == [1, 3]
    assert nonfinite_rows(torch.randn(4, 7)) == []


def test_the_cache_holds_what_kv_cache_bytes_per_block_says(tiny):
    engine, _ = tiny
    runner = engine.runner
    per_block = kv_cache_bytes_per_block(engine.model, runner.block_size, runner.kv_caches[0].dtype)
    total = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert total == per_block * (engine.block_manager.num_blocks + 1)  # + the null block


def test_zero_blocks_clears_those_blocks_and_no_other(tiny):
    engine, _ = tiny
    runner = engine.runner
    saved = [c.clone() for c in runner.kv_caches]
    try:
        for c in runner.kv_caches:
            c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(1)))
        before = [c.clone() for c in runner.kv_caches]
        runner.zero_blocks([2, 5])
        for cache, old in zip(runner.kv_caches, before):
            assert not cache[:, [2, 5]].any()
            keep = [b for b in range(cache.shape[1]) if b not in (2, 5)]
            assert torch.equal(cache[:, keep], old[:, keep])
    finally:
        for c, s in zip(runner.kv_caches, saved):
            c.copy_(s)
