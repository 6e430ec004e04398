"""Structured outputs through the engine on the default model: constrained and free requests in one
continuously batched run, n > 1, stop strings, chunked prefill and preemption; the free requests'
text is what it is without the constrained ones beside them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgellm.llm import LLM
from edgellm.sampling import SamplingParams
from edgellm.structured import StructuredOutputs
from tests.helpers.structured_schemas import schemas

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Seoul", "Paris", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
FREE = ["The capital of France is", "Once upon a time", "Water boils at"]


@pytest.fixture(scope="module")
def llm():
    # exact: the free requests are compared with a run without the constrained ones (batch invariance);
    # a small KV cache and token budget so that the mixed run preempts and chunks its prefills
    return LLM(None, max_model_len=256, cpu_quant="exact", kv_cache_memory=12 * 2**20,
               max_num_batched_tokens=64)


def test_constrained_and_free_requests_share_the_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.outputs[0].text for o in llm.generate(FREE, free)]
    long_prompt = "Describe a person as JSON. " + "Give a name, an age and a city. " * 12  # chunked prefill
    constrained = [
        SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json=PERSON)),
        SamplingParams(max_tokens=60, temperature=0.9, seed=3, n=3,
                       structured_outputs=StructuredOutputs(json=schemas(1, seed=7)[0])),
        SamplingParams(max_tokens=8, temperature=0.7, seed=1, structured_outputs=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(max_tokens=60, temperature=0, stop=['",'], structured_outputs=StructuredOutputs(json=PERSON)),
    ]
    prompts = FREE + [long_prompt, "Fill in the record:", "Is water wet?", "Describe a person as JSON."]
    outs = llm.generate(prompts, [free] * 3 + constrained)
    assert [o.outputs[0].text for o in outs[:3]] == alone
    person = outs[3].outputs[0]
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    record_schema = schemas(1, seed=7)[0]
    assert len(outs[4].outputs) == 3
    for choice in outs[4].outputs:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), record_schema)
        else:  # cut by max_tokens: a prefix, and said so
            assert choice.finish_reason == "length"
    assert sum(c.finish_reason == "stop" for c in outs[4].outputs) >= 2
    assert outs[5].outputs[0].text in ("yes", "no")
    cut = outs[6].outputs[0]  # the stop string ends a valid prefix early
    assert cut.finish_reason == "stop" and cut.text.startswith('{"name": "') and '",' not in cut.text
    assert llm.engine.scheduler.num_preemptions > 0


def test_grammar_end_stops_even_with_ignore_eos(llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, min_tokens=30,
                            structured_outputs=StructuredOutputs(choice=["alpha", "beta"]))
    out = llm.generate(["Pick one:"], params)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


def test_bad_constraint_is_a_value_error_before_anything_runs(llm):
    with pytest.raises(ValueError, match="cannot compile"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="(")))
    assert not llm.engine.has_unfinished_requests()


def test_auto_heads_masked_argmax_gives_the_fp32_heads_tokens(monkeypatch):
    """CPU mode auto: a greedy grammar row's logits come from the int8 head with the mask applied
    inside it (CausalLM.compute_logits(allowed=...)); its tokens are those of the fp32 head + mask."""
    auto = LLM(None, max_model_len=256, cpu_quant="auto")
    assert auto.engine.model.supports_masked_argmax
    params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json=s))
              for s in [PERSON] + schemas(3, seed=11)]
    prompts = ["Describe a person as JSON.", "Fill in:", "A record:", "JSON please:"]
    calls = []
    head = auto.engine.model.fast_logits
    orig = head.masked
    monkeypatch.setattr(head, "masked", lambda x, allowed: (calls.append(x.shape[0]), orig(x, allowed))[1])
    fast = [o.outputs[0].token_ids for o in auto.generate(prompts, params)]
    assert calls  # the masked head ran
    monkeypatch.setattr(type(auto.engine.model), "supports_masked_argmax", property(lambda self: False))
    full = [o.outputs[0].token_ids for o in auto.generate(prompts, params)]
    assert fast == full
