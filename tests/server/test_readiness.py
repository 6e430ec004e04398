"""What routers and probes read from a replica: /health 503 while the model loads and 200 once it
is ready, model routes answering an OpenAI-shaped 503 meanwhile, /v1/models with max_model_len,
and the vLLM gauges (requests running / waiting, KV cache usage, cache_config_info).

The app is the one `edgellm serve` runs (launch.serving_app) on a real uvicorn; the load is made
slow through serving_app's build hook, which holds the real build until the test lets it go.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from edgellm.cli import build_parser
from edgellm.server.launch import build_engine, select_spec, serving_app
from tests.helpers.serverutil import ThreadServer, build_tiny_chat_model, is_openai_error, scrape

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def serve_args(model, *extra: str):
    return build_parser().parse_args(["serve", "--model", str(model), "--kv-cache-memory", "16M",
                                      "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
                                      "--served-model-name", "tiny", *extra])


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def info_labels(url: str) -> dict[str, str]:
    text = httpx.get(url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert line.endswith(" 1.0")
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def hold_after_first_output(engine, resume: threading.Event) -> None:
    """Make the engine's steps wait for `resume` once a step has given outputs, so that a request
    is still running, holding KV, while the test reads the gauges (a tiny model would otherwise
    finish it before the scrape)."""
    inner, given = engine.step, []

    def step():
        if given:
            assert resume.wait(60), "the test never resumed the engine"
        outputs = inner()
        given.extend(outputs[:1])
        return outputs

    engine.step = step


def test_health_is_503_until_loaded_then_200_and_metrics_are_sane(tiny_chat):
    # the engine in this process, so the test can hold its steps (the gauges of the engine-core
    # process are read mid-stream in tests/server/test_api.py)
    args = serve_args(tiny_chat, "--engine-core", "thread")
    spec = select_spec(args)
    entered, gate, resume = threading.Event(), threading.Event(), threading.Event()

    def slow_build(spec, args):
        entered.set()
        assert gate.wait(120), "the test never released the load"
        engine = build_engine(spec, args)
        hold_after_first_output(engine.engine, resume)
        return engine

    loaded: list[bool] = []  # after_load: called once, after the load and the warm-up
    app, served = serving_app(args, spec, None, build=slow_build,
                              after_load=lambda: loaded.append(served.engine is not None))
    try:
        with ThreadServer(app) as srv:
            assert entered.wait(30), "the load did not start with the server"
            r = httpx.get(srv.url + "/health")
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            for method, path, body in (("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
                                       ("POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None)):
                r = httpx.request(method, srv.url + path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert is_openai_error(r.json()) and r.json()["error"]["code"] == "model_loading"
                assert int(r.headers["retry-after"]) > 0
            m = httpx.get(srv.url + "/metrics")
            assert m.status_code == 200 and "vllm:num_requests_running{" not in m.text
            assert served.engine is None and not loaded

            gate.set()
            wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 180, "/health 200")
            assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
            assert loaded == [True]
            cards = httpx.get(srv.url + "/v1/models").json()["data"]
            assert [(c["id"], c["max_model_len"]) for c in cards] == [("tiny", MAX_MODEL_LEN)]
            assert httpx.get(srv.url + "/v1/models/tiny").json()["max_model_len"] == MAX_MODEL_LEN

            # mid-stream: one request running, holding KV
            body = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 50, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                live = scrape(srv.url)  # the engine is held after its first output
                assert live["vllm:num_requests_running"] == 1
                assert live["vllm:num_requests_waiting"] == 0
                held = served.engine.stats()["kv_blocks_held"]
                assert held >= 3  # 40 prompt tokens in 16-token blocks
                total = served.engine.stats()["kv_blocks_total"]
                assert 0 < live["vllm:kv_cache_usage_perc"] <= 1
                assert abs(live["vllm:kv_cache_usage_perc"] - held / total) < 1.0 / total + 1e-9
                resume.set()
                for _ in lines:
                    pass
            for _ in range(3):  # the same prompt again: prefix-cache hits
                r = httpx.post(srv.url + "/v1/completions", timeout=60,
                               json={"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 3})
                assert r.status_code == 200
            after = scrape(srv.url)
            assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
            assert after["vllm:kv_cache_usage_perc"] == 0.0  # everything finished: no block held
            assert after['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 4
            assert after["vllm:prefix_cache_hits_total"] >= 3 * 32
            info = info_labels(srv.url)
            assert info["model_name"] == "tiny" and info["block_size"] == "16"
            assert info["num_gpu_blocks"] == str(served.engine.stats()["kv_blocks_total"])
            assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"
    finally:
        gate.set()
        resume.set()
        if served.engine is not None:
            served.engine.shutdown()


def test_a_failed_load_is_reported_and_health_stays_503(tiny_chat):
    args = serve_args(tiny_chat)
    failures: list[BaseException] = []

    def broken_build(spec, args):
        raise ValueError("the checkpoint is unreadable")

    app, served = serving_app(args, select_spec(args), None, build=broken_build, on_load_failure=failures.append)
    with ThreadServer(app) as srv:
        wait_for(lambda: failures, 30, "the load failure")
        assert str(failures[0]) == "the checkpoint is unreadable"
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert served.engine is None
