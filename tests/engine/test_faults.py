"""Engine faults: an exception inside one step fails the requests of that step (a 500-class error
object over HTTP) and the engine keeps serving the others; a NaN in one request's logits fails that
request only, and its KV never reaches the prefix cache. Real engine (tiny random Llama), real app."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.engine.async_engine import AsyncEngine
from edgellm.sampling import SamplingParams
from edgellm.server.app import create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.serverutil import ThreadServer, is_openai_error

POISON = 7  # the token whose embedding row is set to NaN
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CLEAN = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38], [41, 42]]
# 40 tokens (two full blocks) with the poison at position 5: enough to be prefix-cached
POISONED = [100 + i for i in range(5)] + [POISON] + [150 + i for i in range(34)]


def make_engine(tiny_dir, **kw) -> AsyncEngine:
    path = tiny_dir("llama")[0]
    cfg = {"model": str(path), "kv_cache_memory": 4 << 20, "max_model_len": 256, "max_num_seqs": 8}
    cfg.update(kw)
    return AsyncEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = make_engine(tiny_dir)
    yield eng
    eng.shutdown()


async def _final(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    final = None
    async for out in engine.generate(rid, prompt, params):
        final = out
    return final


def run_all(engine: AsyncEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict:
    async def go():
        outs = await asyncio.gather(*[_final(engine, rid, p, params) for rid, p in prompts.items()])
        return dict(zip(prompts, outs))

    return asyncio.run(go())


def reference(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt served alone."""
    return [run_all(engine, {f"ref-{i}": p})[f"ref-{i}"].outputs[0].token_ids for i, p in enumerate(prompts)]


def assert_idle(engine: AsyncEngine) -> None:
    s = engine.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["kv_blocks_held"] == 0
    assert engine.num_requests == 0


class poisoned_embedding:
    """Make one token's embedding NaN: any request containing it produces NaN logits."""

    def __init__(self, engine: AsyncEngine, token: int = POISON) -> None:
        self.weight = engine.engine.model.model.embed_tokens.weight
        self.token = token

    def __enter__(self):
        self.saved = self.weight.data[self.token].clone()
        self.weight.data[self.token] = float("nan")

    def __exit__(self, *exc):
        self.weight.data[self.token] = self.saved


# ------------------------------------------------------------------ NaN
def test_nan_logits_fail_that_request_only(engine):
    refs = reference(engine, CLEAN + [POISONED])
    engine.engine.block_manager.reset_prefix_cache()  # the poisoned prompt must be computed, not hit
    with poisoned_embedding(engine):
        prompts = {f"clean-{i}": p for i, p in enumerate(CLEAN)}
        prompts["poisoned"] = POISONED
        outs = run_all(engine, prompts)  # one batch: all are admitted in the same step
    bad = outs["poisoned"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "NaN" in bad.error and bad.outputs[0].token_ids == []
    for i in range(len(CLEAN)):
        out = outs[f"clean-{i}"]
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == refs[i], i  # untouched by the neighbour's NaN
    assert_idle(engine)
    # its blocks were kept out of the prefix cache: served again (clean weights), it is right
    again = run_all(engine, {"poisoned-again": POISONED})["poisoned-again"]
    assert again.outputs[0].token_ids == refs[-1]


def test_nan_mid_decode_fails_that_request_only(engine):
    """The poison arrives as a generated token's embedding: the request fails mid-decode."""
    refs = reference(engine, CLEAN)
    prompt = [60, 61, 62]
    first = reference(engine, [prompt])[0]
    # the first generated token (from the 4th on) that no clean request reads or writes: poisoning
    # its embedding breaks this request one step after it is generated, and only this request
    clean = {t for p, r in zip(CLEAN, refs) for t in (*p, *r)}
    at = next(i for i in range(3, len(first)) if first[i] not in clean and first[i] not in (*prompt, *first[:i]))
    poison = first[at]
    with poisoned_embedding(engine, poison):
        outs = run_all(engine, {"victim": prompt, **{f"c{i}": p for i, p in enumerate(CLEAN)}})
    victim = outs["victim"]
    assert victim.outputs[0].finish_reason == "error" and "NaN" in victim.error
    assert victim.outputs[0].token_ids == first[:at + 1]
    for i in range(len(CLEAN)):
        assert outs[f"c{i}"].outputs[0].token_ids == refs[i]
    assert_idle(engine)


def test_nan_kv_of_a_failed_request_never_reaches_another(tiny_dir, engine):
    """The failed request held block 0, which the CPU decode path reads as table padding (masked,
    but 0 x NaN is NaN), and its freed blocks are reused: neither may leak NaN into a neighbour."""
    long_prompt, short_prompt = [200 + i for i in range(20)], [90, 91, 92]
    refs = reference(engine, [long_prompt, short_prompt])
    fresh = make_engine(tiny_dir)  # free list in order: the first admitted request takes block 0
    try:
        with poisoned_embedding(fresh):
            outs = run_all(fresh, {"poisoned": POISONED, "long": long_prompt, "short": short_prompt})
            assert outs["poisoned"].outputs[0].finish_reason == "error"
            assert outs["long"].outputs[0].token_ids == refs[0]
            assert outs["short"].outputs[0].token_ids == refs[1]
            # the poisoned request's freed blocks go to new requests next
            outs = run_all(fresh, {f"n{i}": p for i, p in enumerate([short_prompt, long_prompt] * 3)})
        for i, p in enumerate([short_prompt, long_prompt] * 3):
            assert outs[f"n{i}"].outputs[0].token_ids == refs[0 if p is long_prompt else 1]
        assert_idle(fresh)
    finally:
        fresh.shutdown()


def test_prompt_logits_mode_still_returns_raw_logits(tiny_dir):
    from edgellm import LLM

    llm = LLM(str(tiny_dir("llama")[0]), kv_cache_memory=1 << 20, max_model_len=64)
    llm.engine.model.model.embed_tokens.weight.data[POISON] = float("nan")
    logits = llm.prompt_logits([[1, 2, POISON, 4]])[0]
    assert torch.isnan(logits[2:]).all()  # not checked, not refused: the caller asked for raw logits


# ------------------------------------------------------- step exceptions
class FailingStep:
    """Make runner.execute raise once: on the first step that holds `trigger` after `after` steps
    of it (trigger None: the next step, whatever it holds)."""

    def __init__(self, engine: AsyncEngine, trigger: str | None, after: int = 3) -> None:
        self.runner = engine.engine.runner
        self.original = self.runner.execute
        self.trigger, self.after = trigger, after
        self.seen = 0
        self.failed_step: list[str] | None = None

    def __call__(self, sched):
        ids = [item.seq.request_id for item in sched.scheduled]
        if self.failed_step is None and (self.trigger is None or self.trigger in ids):
            self.seen += 1
            if self.seen > self.after:
                self.failed_step = ids
                raise RuntimeError("injected fault: secret detail")
        return self.original(sched)

    def __enter__(self):
        self.runner.execute = self
        return self

    def __exit__(self, *exc):
        self.runner.execute = self.original


def test_step_exception_fails_that_steps_requests_only(tiny_dir, caplog):
    # two seats: the first two requests run, the other two wait and are not in the failing step
    eng = make_engine(tiny_dir, max_num_seqs=2)
    try:
        prompts = {"victim": [50, 51, 52], "neighbour": [53, 54], "later-0": CLEAN[0], "later-1": CLEAN[1]}
        refs = dict(zip(prompts, reference(eng, list(prompts.values()))))
        with FailingStep(eng, "victim") as fault:
            outs = run_all(eng, prompts)
        assert sorted(fault.failed_step) == ["neighbour", "victim"]
        for rid in fault.failed_step:
            out = outs[rid]
            assert out.finished and out.outputs[0].finish_reason == "error"
            assert out.error == "internal error in the engine step (RuntimeError)"  # no internals
        for rid in ("later-0", "later-1"):
            assert outs[rid].outputs[0].finish_reason == "length"
            assert outs[rid].outputs[0].token_ids == refs[rid]
        assert "injected fault: secret detail" in caplog.text  # the detail goes to the log
        assert_idle(eng)
        # and it keeps serving, exactly
        assert run_all(eng, {"after": prompts["victim"]})["after"].outputs[0].token_ids == refs["victim"]
    finally:
        eng.shutdown()


def test_planner_exception_fails_every_unfinished_request(tiny_dir):
    eng = make_engine(tiny_dir)
    try:
        sched = eng.engine.scheduler
        original = sched.schedule
        calls = {"n": 0}

        def boom():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("planner bug")
            return original()

        sched.schedule = boom
        outs = run_all(eng, {"a": CLEAN[0], "b": CLEAN[1]})
        sched.schedule = original
        assert {o.outputs[0].finish_reason for o in outs.values()} == {"error"}
        assert_idle(eng)
        assert run_all(eng, {"c": CLEAN[2]})["c"].outputs[0].finish_reason == "length"
    finally:
        eng.shutdown()


def test_inbox_fault_fails_requests_and_does_not_hang(tiny_dir):
    eng = make_engine(tiny_dir)
    try:
        original = eng.engine.abort_request

        def broken(rid):
            raise RuntimeError("abort bug")

        async def go():
            gen = eng.generate("x", CLEAN[0], SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
            await gen.__anext__()
            eng.engine.abort_request = broken
            await gen.aclose()  # aborts: the inbox raises
            return await asyncio.wait_for(_final(eng, "y", CLEAN[1]), timeout=30)

        out = asyncio.run(go())
        eng.engine.abort_request = original
        assert out.outputs[0].finish_reason == "length"
        assert eng._thread.is_alive()
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_requests_after_shutdown_fail_at_once(tiny_dir):
    from edgellm.engine.async_engine import EngineDeadError

    eng = make_engine(tiny_dir)
    eng.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(_final(eng, "late", CLEAN[0]), timeout=10))


# ------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def http(engine):
    served = ServedModel(names=["tiny"], engine=engine, max_waiting_requests=8)
    with ThreadServer(create_app([served])) as srv:
        srv.served = served
        yield srv


def _complete(url: str, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_http_nan_request_gets_500_the_others_200(http, engine):
    refs = reference(engine, CLEAN)
    engine.engine.block_manager.reset_prefix_cache()  # (an earlier test cached the clean prompt)
    results: dict[str, httpx.Response] = {}

    def call(name, prompt, stream=False):
        results[name] = _complete(http.url, prompt, stream)

    with poisoned_embedding(engine):
        threads = [threading.Thread(target=call, args=(f"c{i}", p)) for i, p in enumerate(CLEAN)]
        threads += [threading.Thread(target=call, args=("bad", POISONED)),
                    threading.Thread(target=call, args=("bad-stream", POISONED, True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    bad = results["bad"]
    assert bad.status_code == 500 and is_openai_error(bad.json())
    err = bad.json()["error"]
    assert err["code"] == "engine_error" and err["type"] == "internal_server_error" and "NaN" in err["message"]
    stream = results["bad-stream"]
    assert stream.status_code == 200 and '"code":"engine_error"' in stream.text
    assert stream.text.endswith("data: [DONE]\n\n")
    for i in range(len(CLEAN)):
        r = results[f"c{i}"]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == len(refs[i])
    assert http.served.inflight == 0
    assert_idle(engine)


def test_http_step_exception_gives_500_and_serving_goes_on(http, engine):
    with FailingStep(engine, None, after=0):
        r = _complete(http.url, CLEAN[0])
    assert r.status_code == 500 and is_openai_error(r.json())
    assert r.json()["error"]["code"] == "engine_error" and "secret" not in r.text
    assert httpx.get(http.url + "/health").json() == {"status": "ok"}
    ok = _complete(http.url, CLEAN[0])
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert http.served.inflight == 0
    assert_idle(engine)
