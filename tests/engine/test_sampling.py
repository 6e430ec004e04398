"""Sampler: each transform checked against a direct computation; seeded draws
reproducible whatever the batch; the empirical distribution matches."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from edgellm.sampling import Sampler, SamplingParams, apply_penalties, filter_logits

V = 50


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)


def logits(seed: int = 0, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_top_k_matches_direct_computation():
    x = logits(1)[0]
    out = filter_logits(x.clone(), top_k=7, top_p=1.0, min_p=0.0)
    kept = set(torch.nonzero(out > float("-inf")).flatten().tolist())
    assert kept == set(torch.argsort(x, descending=True)[:7].tolist())
    assert torch.equal(out[list(kept)], x[list(kept)])


def test_top_p_keeps_smallest_set_reaching_p():
    x = logits(2)[0]
    p = 0.62
    out = filter_logits(x.clone(), top_k=0, top_p=p, min_p=0.0)
    probs = x.softmax(-1)
    order = torch.argsort(probs, descending=True).tolist()
    total, want = 0.0, set()
    for tok in order:
        want.add(tok)
        total += probs[tok].item()
        if total >= p:
            break
    assert set(torch.nonzero(out > float("-inf")).flatten().tolist()) == want


def test_top_k_then_top_p_renormalizes_over_top_k():
    x = logits(3)[0]
    out = filter_logits(x.clone(), top_k=10, top_p=0.5, min_p=0.0)
    top10 = torch.argsort(x, descending=True)[:10]
    probs = x[top10].softmax(-1)  # renormalized over the top 10
    n = int((torch.cumsum(probs, 0) < 0.5).sum().item()) + 1
    assert set(torch.nonzero(out > float("-inf")).flatten().tolist()) == set(top10[:n].tolist())


def test_min_p_drops_tokens_below_fraction_of_max():
    x = logits(4)[0]
    out = filter_logits(x.clone(), top_k=0, top_p=1.0, min_p=0.1)
    probs = x.softmax(-1)
    want = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    assert set(torch.nonzero(out > float("-inf")).flatten().tolist()) == want


def test_penalties_match_direct_computation():
    x = logits(5)[0]
    row = Row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
              prompt_token_ids=[1, 2, 3], output_token_ids=[3, 4, 4, 4, 9])
    got = apply_penalties(x.clone(), row)
    want = x.clone()
    for t in {1, 2, 3, 4, 9}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, c in {3: 1, 4: 3, 9: 1}.items():
        want[t] -= 0.5 * c + 0.25
    assert torch.allclose(got, want)


def test_greedy_and_penalized_greedy():
    x = logits(6, 2)
    best = int(x[1].argmax())
    rows = [Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(temperature=0.0, frequency_penalty=2.0), output_token_ids=[best] * 10)]
    out = Sampler()(x, rows)
    assert out.token_ids[0] == int(x[0].argmax())
    assert out.token_ids[1] != best


def test_seeded_sampling_reproducible_regardless_of_batch():
    x = logits(7, 4)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler()(x[2:3], [Row(p)]).token_ids[0] for _ in range(1)]
    rows = [Row(SamplingParams(temperature=1.0)), Row(SamplingParams(temperature=0.5)), Row(p), Row(p)]
    batched = Sampler()(x, rows).token_ids
    assert batched[2] == alone[0]
    # a sequence of draws from one generator is reproducible
    r1, r2 = Row(p), Row(p)
    s1 = [Sampler()(x[2:3], [r1]).token_ids[0] for _ in range(20)]
    s2 = [Sampler()(x[2:3], [r2]).token_ids[0] for _ in range(20)]
    assert s1 == s2 and len(set(s1)) > 1


def test_empirical_distribution_matches_filtered_softmax():
    torch.manual_seed(0)
    x = logits(8)[0]
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, seed=5)
    row = Row(params)
    n = 6000
    draws = torch.tensor([Sampler()(x[None], [row]).token_ids[0] for _ in range(n)])
    expect = filter_logits(x / 0.7, 6, 0.9, 0.0).softmax(-1)
    freq = torch.bincount(draws, minlength=V).float() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(expect).flatten().tolist())
    assert 0.5 * (freq - expect).abs().sum() < 0.03  # total variation distance


def test_min_tokens_bans_eos_and_stop_ids():
    x = torch.zeros(1, V)
    x[0, 3] = 10.0  # eos would win
    x[0, 5] = 9.0  # stop token next
    row = Row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5]), eos_token_ids=[3])
    assert Sampler()(x, [row]).token_ids[0] not in (3, 5)
    row.output_token_ids = [1, 1]
    assert Sampler()(x, [row]).token_ids[0] == 3


def test_logprobs_are_raw_log_softmax():
    x = logits(9, 2)
    rows = [Row(SamplingParams(temperature=0.0, logprobs=3)), Row(SamplingParams(temperature=0.0))]
    out = Sampler()(x, rows)
    lp = torch.log_softmax(x[0], -1)
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(lp[out.token_ids[0]].item())
    assert [t for t, _ in top] == torch.topk(lp, 3).indices.tolist()
    assert out.logprobs[1] is None


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(max_tokens=0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
    dict(min_p=2.0), dict(n=0), dict(presence_penalty=3.0), dict(repetition_penalty=0.0),
    dict(logprobs=99), dict(stop=[""]), dict(temperature=float("nan")), dict(min_tokens=5, max_tokens=2),
])
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(ValueError) as err:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(err.value)


def test_premasked_grammar_rows_are_not_masked_again():
    """Rows whose logits the head already masked skip the sampler's own mask; the others get it."""

    @dataclass
    class GrammarRow(Row):
        grammar: object = "matcher"

    class Masks:
        def __init__(self):
            self.rows: list[int] = []

        def mask(self, work, matchers, rows):
            self.rows += rows
            work[rows, 0] = float("-inf")  # this fake grammar forbids token 0

    x = logits(3, 3)
    x[:, 0] = 100.0  # token 0 wins unless masked
    masks = Masks()
    rows = [GrammarRow(SamplingParams(temperature=0)) for _ in range(3)]
    out = Sampler(masks)(x, rows, premasked=[True, False, True])
    assert masks.rows == [1]
    assert out.token_ids[0] == 0 and out.token_ids[2] == 0 and out.token_ids[1] != 0
