"""Server guard rails that need failures on demand: API key, body limit, queue bound (503 +
Retry-After), engine errors (500 without internals, the server keeps serving), a dead engine.

The app is the real one on a real uvicorn (127.0.0.1, in a thread), over a scripted stand-in engine
whose behaviour each request picks with its first prompt token id.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import httpx
import openai
import pytest

from edgellm.server import launch
from edgellm.server.app import ServerSettings, create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.scripted_engine import (
    BLOCK,
    DEAD,
    ENGINE_ERROR,
    OK,
    PREPARE_RAISES,
    RAISE,
    ScriptedEngine,
)
from tests.helpers.serverutil import ThreadServer

KEY = "sekret-key-123"
@pytest.fixture(scope="module")
def guarded():
    engine = ScriptedEngine()
    served = ServedModel(names=["scripted"], engine=engine, max_waiting_requests=1)
    app = create_app([served], ServerSettings(api_key=KEY, max_body_bytes=2048))
    with ThreadServer(app) as srv:
        srv.engine = engine
        srv.served = served
        yield srv


@pytest.fixture(scope="module")
def public_metrics():
    served = ServedModel(names=["scripted"], engine=ScriptedEngine(), max_waiting_requests=1)
    with ThreadServer(create_app([served], ServerSettings(api_key=KEY, metrics_public=True))) as srv:
        yield srv


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(srv, prompt, key=KEY, **body):
    return httpx.post(srv.url + "/v1/completions", headers=auth(key), timeout=30,
                      json={"model": "scripted", "prompt": prompt, "max_tokens": 2, **body})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    assert "Traceback" not in r.text and "secret" not in r.text and "kaboom" not in r.text
    return err


# --------------------------------------------------------------------- key
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"), ("GET", "/v1/models/scripted"), ("GET", "/no/such/path"),
])
def test_every_endpoint_but_health_needs_the_key(guarded, method, path):
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    auth(KEY + "x"), auth(KEY[:-1])):
        r = httpx.request(method, guarded.url + path, headers=headers, json={})
        err = assert_error(r, 401, "invalid_api_key")
        assert err["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, guarded.url + path, headers=auth(), json={})
    assert r.status_code != 401


def test_health_needs_no_key(guarded):
    r = httpx.get(guarded.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_openai_client_with_and_without_key(guarded):
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["scripted"]
    out = good.completions.create(model="scripted", prompt=[OK, 11], max_tokens=2)
    assert out.choices[0].text == "xx" and out.usage.completion_tokens == 2


def test_metrics_public_option(public_metrics):
    assert httpx.get(public_metrics.url + "/metrics").status_code == 200
    assert httpx.get(public_metrics.url + "/v1/models").status_code == 401


# -------------------------------------------------------------------- size
def test_body_limit_413(guarded):
    r = post(guarded, [OK], stop="y" * 4000)
    assert_error(r, 413, "request_too_large")
    # the key is checked before the size
    r = httpx.post(guarded.url + "/v1/completions", content=b"x" * 5000)
    assert r.status_code == 401
    # chunked upload: no Content-Length, refused while reading
    r = httpx.post(guarded.url + "/v1/completions", headers=auth(), content=iter([b"{" + b" " * 1500] * 3))
    assert_error(r, 413, "request_too_large")


# ------------------------------------------------------------------- queue
def test_queue_bound_gives_503_with_retry_after(guarded):
    engine, served = guarded.engine, guarded.served
    engine.release.clear()
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(post(guarded, [BLOCK]))) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while served.inflight < 2:  # max_num_seqs 1 + max_waiting_requests 1
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = post(guarded, [OK])
    err = assert_error(r, 503, "server_overloaded")
    assert r.headers["retry-after"] == "1"
    assert "overloaded" in err["message"]
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="scripted", prompt=[OK], max_tokens=2, stream=True)
    assert info.value.status_code == 503
    # n counts: a request that alone needs more room than there is
    engine.release.set()
    for t in threads:
        t.join(timeout=10)
    assert [r.status_code for r in results] == [200, 200]
    assert served.inflight == 0
    assert post(guarded, [OK]).status_code == 200
    # a request that alone needs more room than there is can never run: 400, not a retry loop
    err = assert_error(post(guarded, [OK], n=3), 400, "too_many_sequences")
    assert err["param"] == "n"
    m = httpx.get(guarded.url + "/metrics", headers=auth()).text
    assert 'edgellm:requests_rejected_total{status="503"} 2.0' in m


# ------------------------------------------------------------------ errors
def test_engine_error_fails_only_that_request(guarded):
    err = assert_error(post(guarded, [ENGINE_ERROR]), 500, "engine_error")
    assert err["type"] == "internal_server_error"
    assert post(guarded, [OK]).status_code == 200  # the server keeps serving
    # streamed: an error event, then [DONE]; the openai client raises
    with httpx.stream("POST", guarded.url + "/v1/completions", headers=auth(),
                      json={"prompt": [ENGINE_ERROR], "stream": True}) as r:
        body = r.read().decode()
    assert r.status_code == 200
    assert '"code":"engine_error"' in body and body.endswith("data: [DONE]\n\n")
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model="scripted", prompt=[ENGINE_ERROR], stream=True))
    assert guarded.served.inflight == 0


def test_internal_errors_never_leak(guarded):
    assert_error(post(guarded, [RAISE]), 500, "internal_error")
    assert_error(post(guarded, [PREPARE_RAISES]), 500, "internal_error")
    assert_error(post(guarded, [DEAD]), 503, "engine_dead")
    assert post(guarded, [OK]).status_code == 200
    assert guarded.served.inflight == 0


def test_loopback_detection_and_wide_bind_warning(caplog, monkeypatch):
    assert launch._is_loopback("127.0.0.1") and launch._is_loopback("::1") and launch._is_loopback("localhost")
    assert not launch._is_loopback("0.0.0.0") and not launch._is_loopback("192.168.1.5")

    def stop(args):
        raise SystemExit(0)

    monkeypatch.setattr(launch, "select_spec", stop)
    monkeypatch.delenv("EDGELLM_API_KEY", raising=False)
    args = argparse.Namespace(api_key=None, host="0.0.0.0")
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):
        launch.serve(args)
    assert "without --api-key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(SystemExit):
        launch.serve(argparse.Namespace(api_key="k", host="0.0.0.0"))
    assert "without --api-key" not in caplog.text
