"""The request field `priority` through the HTTP API, as vLLM answers it: under --scheduling-policy
fcfs anything but 0 is a 400 naming the field; a non-integer is a 400 under either policy; under
priority, any integer is accepted and the request runs. Real app, real uvicorn, a tiny real engine."""

from __future__ import annotations

import httpx
import pytest

from edgellm.config import EngineConfig
from edgellm.engine.async_engine import AsyncEngine
from edgellm.server.app import create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.serverutil import ThreadServer, is_openai_error
from tests.helpers.tiny_models import build_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))
    return path


def _serve(tiny_llama, policy: str):
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=4 << 20, max_model_len=64,
                                      scheduling_policy=policy))
    try:
        with ThreadServer(create_app([ServedModel(names=["tiny"], engine=engine, max_waiting_requests=4)])) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fcfs_server(tiny_llama):
    yield from _serve(tiny_llama, "fcfs")


@pytest.fixture(scope="module")
def priority_server(tiny_llama):
    yield from _serve(tiny_llama, "priority")


@pytest.fixture(params=["fcfs", "priority"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def post(srv, path: str, **body) -> httpx.Response:
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, **body}
    return httpx.post(srv.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority_other_than_zero_is_400_under_fcfs(fcfs_server, path):
    server = fcfs_server
    body = {} if path == "/v1/completions" else {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    r = post(server, path, priority=3, **body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert is_openai_error(err) and err["error"]["param"] == "priority"
    assert "priority" in err["error"]["message"] and "fcfs" in err["error"]["message"]


def test_priority_zero_runs_under_both_policies(server):
    r = post(server, "/v1/completions", priority=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("bad", ["1", 1.5, True, None, [1]])
def test_non_integer_priority_is_400(server, bad):
    r = post(server, "/v1/completions", priority=bad)
    assert r.status_code == 400, r.text
    assert is_openai_error(r.json()) and r.json()["error"]["param"] == "priority"


def test_any_integer_priority_runs_under_priority(priority_server):
    server = priority_server
    for prio in (-10, 0, 7):
        r = post(server, "/v1/completions", priority=prio)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
