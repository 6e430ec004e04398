"""The embedded default model (SmolLM2-135M-Instruct: Q4_1 linears, Q8_0 embedding) served
from its own 4-bit blocks (EDGELLM_CPU_QUANT=fast) against the dequantized path (exact,
the default, which tests/models/test_default_model.py holds to transformers' GGUF loader).

The fast path runs bf16 activations (int4 GEMV for small steps, a bf16 matmul over the
dequantized weight for larger ones), so exact equality of logits is impossible; greedy
text must still agree, and teacher-forced top-1 must agree almost everywhere on both
paths (measured: benchmarks/cpu_quant_decode.py)."""

from __future__ import annotations

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.quant.linear_kernels.onednn import packed_available, unpack_bf16

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child."]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _kernels(llm: LLM) -> set[str]:
    return {type(m.kernel).__name__ for m in llm.engine.model.modules() if hasattr(m, "kernel")}


def _kernel_bytes(llm: LLM) -> int:
    total = 0
    for m in llm.engine.model.modules():
        if hasattr(m, "kernel"):  # what decode reads: the fp32 prefill copy aside
            total += sum(t.numel() * t.element_size() for name, t in vars(m.kernel).items()
                         if isinstance(t, torch.Tensor) and name != "dense_weight")
    return total


@pytest.fixture(scope="module")
def exact():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGELLM_CPU_QUANT", "exact")
        return LLM(kv_cache_memory=32 << 20, max_model_len=512)


@pytest.fixture(scope="module")
def fast():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGELLM_CPU_QUANT", "exact")  # the engine option wins over the environment
        # 12-token steps: prefill chunks run the int4 GEMV (up to its gemv_max_rows) like decode does
        return LLM(kv_cache_memory=32 << 20, max_model_len=512, max_num_batched_tokens=12, cpu_quant="fast")


def test_fast_path_keeps_every_linear_in_4_bit(exact, fast):
    assert _kernels(fast) == {"CpuInt4Kernel"}
    assert _kernels(exact) == {"DenseKernel"}
    # the bf16 copy for larger steps (within the default budget) is the exact path's weight, rounded
    pairs = [(m.kernel, e.kernel) for m, e in zip(fast.engine.model.modules(), exact.engine.model.modules())
             if hasattr(m, "kernel")]
    assert all(f.dense_weight is not None and torch.equal(unpack_bf16(f.dense_weight), e.weight.bfloat16())
               for f, e in pairs)
    # ... reordered once for oneDNN's bf16 matmul where torch has it
    assert all(f.dense_weight.is_mkldnn == packed_available() for f, _ in pairs)
    # packed int4 + a nibble copy + scales: under a third of the fp32 weights
    assert _kernel_bytes(fast) < _kernel_bytes(exact) / 3


def test_fast_greedy_text_follows_the_dequantized_path(exact, fast):
    """Greedy tokens equal the exact path's until a position where the exact model itself is
    nearly tied (top-2 logprob gap under NEAR_TIE nats): bf16 noise may pick either there, and
    from then on the texts are different continuations. A fast path that diverged where the
    exact model is confident would be a bug."""
    near_tie = 0.1
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    want = exact.chat(chats, params)
    got = fast.chat(chats, GREEDY)
    equal = 0
    for w, g in zip(want, got):
        wt, gt = w.outputs[0].token_ids, g.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(wt, gt)) if a != b), None)
        if first is None:
            equal += 1
            continue
        top = w.outputs[0].logprobs[first][1]  # the exact model's two best at the divergence
        gap = top[0][1] - top[1][1]
        assert gap < near_tie, (first, gap, w.outputs[0].text, g.outputs[0].text)
    assert equal >= 2  # divergence is the exception


def test_fast_teacher_forced_top1_agrees(exact, fast, monkeypatch):
    chat = [{"role": "user", "content": "Tell me about the history of the bicycle."}]
    out = exact.chat(chat, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    want = exact.prompt_logits([ids])[0]
    gemv = fast.prompt_logits([ids])[0]  # 12-token chunks: every step runs the int4 GEMV
    for module in fast.engine.model.modules():
        if hasattr(module, "kernel"):
            monkeypatch.setattr(module.kernel, "gemv_max_rows", 0)
    dense = fast.prompt_logits([ids])[0]  # every step runs the bf16 matmul
    for got in (gemv, dense):
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert agree > 0.95, agree
        assert 0 < (got - want).abs().max().item() < 0.1 * want.abs().max().item()
    assert not torch.equal(gemv, dense)


@pytest.fixture(scope="module")
def hidden_states(exact):
    """The final-norm hidden states the exact model feeds its head over a few greedy answers."""
    model = exact.engine.model
    seen = []
    original = model.compute_logits

    def record(hidden, *rest, **kw):
        seen.append(hidden.clone())
        return original(hidden, *rest, **kw)

    model.compute_logits = record
    try:
        exact.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    finally:
        model.compute_logits = original
    return torch.cat(seen)


@pytest.mark.parametrize("rows", [3, 9])  # the int8 GEMV; the bf16 copy
def test_fast_logits_head_keeps_the_fp32_argmax(exact, fast, hidden_states, rows, monkeypatch):
    head = fast.engine.model.fast_logits
    assert head is not None and head.codes.dtype == torch.int8 and head.bf16.dtype == torch.bfloat16
    assert exact.engine.model.fast_logits is None
    weight = exact.engine.model.model.embed_tokens.weight  # tied: the embedding is the head
    g = torch.Generator().manual_seed(rows)
    for start in torch.randperm(hidden_states.shape[0] - rows, generator=g)[:6].tolist():
        x = hidden_states[start:start + rows]
        want = torch.nn.functional.linear(x, weight)
        approx, _, bound = head.approximate(x)
        err = (approx - want).abs()
        # the window holds every fp32 logit, with room to spare (measured: under 0.55 of it)
        assert 0 < err.max().item() and (err <= 0.75 * bound).all(), (err / bound).max().item()
        got = head(x)
        assert got.dtype == torch.float32 and torch.equal(got.argmax(-1), want.argmax(-1))
        top = want.argmax(-1, keepdim=True)  # recomputed in fp32
        assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, want)  # the tail stays approximate
        # rows that need every logit (logprobs) take the fp32 weight, in any company
        need = [i % 2 == 0 for i in range(rows)]
        mixed = head(x, need)
        full = [i for i in range(rows) if not need[i]]
        assert torch.equal(mixed[full], want[full])
        assert torch.equal(mixed.argmax(-1), want.argmax(-1))
        # rows that sample at a temperature take the approximate product alone
        sampled = head(x, [False] * rows, [i % 3 == 0 for i in range(rows)])
        rows_s = list(range(0, rows, 3))
        assert torch.equal(sampled[rows_s], head.sampling_logits(x[rows_s]))
        _, _, b = head.approximate(x[rows_s])
        e = (sampled[rows_s] - want[rows_s]).abs()
        assert 0 < e.max().item() and (e <= b).all()  # approximate, within its window
        others = [i for i in range(rows) if i % 3]
        assert torch.equal(sampled[others], want[others])
    # a row with more candidates than MAX_CANDIDATES is recomputed whole
    monkeypatch.setattr(head, "MAX_CANDIDATES", 0)
    assert torch.equal(head(x), torch.nn.functional.linear(x, weight))


def test_cpu_quant_option_is_validated():
    from edgellm.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_quant must be auto, exact or fast"):
        EngineConfig(cpu_quant="turbo")


def test_torch_int_gemvs_compute_rows_independently():
    """A row's result does not depend on the other rows of the call (so the int8 head can take a
    subset of a step's rows). fp32 F.linear gives no such promise: its blocking depends on M."""
    g = torch.Generator().manual_seed(3)
    n, k, group = 96, 128, 32
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
    sz = torch.randn(k // group, n, 2, generator=g).to(torch.bfloat16)
    x = torch.randn(23, k, generator=g).to(torch.bfloat16)
    full = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g).to(torch.bfloat16)
    full8 = torch._weight_int8pack_mm(x, codes, scales)
    for lo, hi in ((0, 1), (5, 6), (3, 11), (0, 23)):
        assert torch.equal(torch.ops.aten._weight_int4pack_mm_for_cpu(x[lo:hi], packed, group, sz), full[lo:hi])
        assert torch.equal(torch._weight_int8pack_mm(x[lo:hi], codes, scales), full8[lo:hi])
