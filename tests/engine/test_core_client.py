"""The engine core in its own process (engine/core_client.py, engine/core_process.py): the same
tokens as the engine in this process, aborts that free the core's KV blocks, structured outputs
and their errors across the pipe, load failures raised by the constructor, and a core that dies
failing every open and later request instead of hanging them. Real engines: the default model
(its tokenizer and grammar) and a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import jsonschema
import pytest

from edgellm.config import EngineConfig
from edgellm.engine.async_engine import EngineDeadError
from edgellm.engine.core_client import EngineProcess
from edgellm.llm import LLM
from edgellm.sampling import SamplingParams
from edgellm.structured import StructuredOutputs
from edgellm.structured.spec import StructuredOutputError

CONFIG = {"max_model_len": 256, "cpu_quant": "exact", "kv_cache_memory": 12 * 2**20}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPTS = ["The capital of France is", "Once upon a time", "Water boils at", "def fib(n):"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def core():
    eng = EngineProcess(EngineConfig(**CONFIG))
    yield eng
    eng.shutdown()


async def final(eng, rid, prompt, params=GREEDY):
    out = None
    async for out in eng.generate(rid, prompt, params):
        pass
    return out


def test_same_tokens_as_the_engine_in_this_process(core):
    async def go():
        return await asyncio.gather(*[final(core, f"p{i}", p) for i, p in enumerate(PROMPTS)])

    outs = asyncio.run(go())
    local = LLM(None, **CONFIG).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in local]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in local]
    assert all(o.finished and len(o.outputs[0].token_ids) > 0 for o in outs)
    assert core.num_requests == 0 and core.stats()["num_running"] == 0


def test_stream_deltas_add_up_to_the_text(core):
    async def go():
        deltas, last = [], None
        async for out in core.generate("d", "Tell me about the sea.", GREEDY):
            deltas.append(out.delta_text)
            last = out
        return deltas, last

    deltas, last = asyncio.run(go())
    assert len(deltas) > 1 and "".join(deltas) == last.outputs[0].text


def test_abort_frees_the_cores_blocks(core):
    async def go():
        gen = core.generate("a", "Count from one to one hundred:", SamplingParams(max_tokens=200))
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        assert core.num_requests == 0
        deadline = time.monotonic() + 10
        while core.stats()["kv_blocks_held"] or core.stats()["num_running"]:
            assert time.monotonic() < deadline, core.stats()
            await asyncio.sleep(0.01)

    asyncio.run(go())


def test_structured_output_and_a_bad_schema(core):
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputs(json=PERSON))
    out = asyncio.run(final(core, "s", "A person as JSON:", params))
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="(unclosed"))
    with pytest.raises(StructuredOutputError):
        asyncio.run(final(core, "bad", "x", bad))
    assert core.num_requests == 0


def test_bad_requests_fail_before_the_pipe(core):
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(final(core, "v", [10**9]))
    with pytest.raises(ValueError, match="priority"):
        asyncio.run(_priority(core))
    assert core.num_requests == 0


async def _priority(core):
    async for _ in core.generate("p", "hi", GREEDY, priority=3):
        pass


def test_a_load_failure_is_raised_by_the_constructor(tmp_path):
    with pytest.raises(ValueError, match="no-such"):
        EngineProcess(EngineConfig(model=str(tmp_path / "no-such.gguf")))


def test_a_dead_core_fails_open_and_later_requests(tiny_dir):
    path = tiny_dir("llama")[0]
    eng = EngineProcess(EngineConfig(model=str(path), kv_cache_memory=4 << 20, max_model_len=256))
    endless = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)

    async def go():
        got = 0
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate("long", [5, 6, 7], endless):
                got += 1
                if got == 3:
                    os.kill(eng._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await final(eng, "later", [5, 6, 7])

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        eng.shutdown()
    assert eng._proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("exc, kind, param", [
    (StructuredOutputError("guided_regex: cannot compile", "guided_regex"), StructuredOutputError, "guided_regex"),
    (ValueError("the prompt is empty"), ValueError, None),
    (TypeError("priority must be an integer"), TypeError, None),
    (KeyError("boom"), RuntimeError, None),
])
def test_errors_cross_the_pipe_as_their_kind(exc, kind, param):
    from edgellm.engine.core_process import error_of, raised

    again = raised(error_of(exc))
    assert type(again) is kind and getattr(again, "param", None) == param
    assert str(exc) in str(again)


def test_a_busy_core_never_blocks_the_caller(tiny_dir):
    """While the core cannot read (stopped here, as in a long step), messages beyond what the pipe
    holds queue up on the API side instead of blocking the event loop; the core then reads them all."""
    path = tiny_dir("llama")[0]
    eng = EngineProcess(EngineConfig(model=str(path), kv_cache_memory=4 << 20, max_model_len=256))
    try:
        os.kill(eng._proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for i in range(40):  # ~8 MB of aborts of unknown ids: far past a socket's buffer
            eng.abort(f"{i}-" + "x" * 200_000)
        assert time.monotonic() - t0 < 2.0
        os.kill(eng._proc.pid, signal.SIGCONT)
        out = asyncio.run(asyncio.wait_for(final(eng, "after", [5, 6, 7]), 60))
        assert out.finished and out.outputs[0].token_ids
    finally:
        os.kill(eng._proc.pid, signal.SIGCONT)
        eng.shutdown()
    assert eng._proc.exitcode == 0
