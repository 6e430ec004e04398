"""Fuzzing the API: the OpenAPI schema the app serves, fed to schemathesis (valid and invalid
bodies, paths and headers), plus the issue's list of hostile values. No response may be a 5xx,
every error must be a well-formed OpenAI error object, a 200 stream must end with [DONE] and
carry no 500-class error event, and afterwards the engine holds nothing.

Real app, real engine: a tiny random Llama with the default model's tokenizer and chat template
(every step ~1 ms, so each fuzzed request runs to its end).
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.config import EngineConfig
from edgellm.engine.async_engine import AsyncEngine
from edgellm.server.app import ServerSettings, create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.serverutil import ThreadServer, build_tiny_chat_model, is_openai_error

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 96
BODY_LIMIT = 256 * 1024
EXAMPLES = int(os.environ.get("EDGELLM_FUZZ_EXAMPLES", "120"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    path = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    engine = AsyncEngine(EngineConfig(model=str(path), kv_cache_memory=16 << 20, max_model_len=MAX_MODEL_LEN,
                                      max_num_seqs=8))
    served = ServedModel(names=["fuzz"], engine=engine, max_waiting_requests=8)
    app = create_app([served], ServerSettings(api_key=KEY, max_body_bytes=BODY_LIMIT))
    with ThreadServer(app) as srv:
        srv.engine, srv.served, srv.app = engine, served, app
        yield srv
    engine.shutdown()


def check_response(status: int, content_type: str, text: str, cut_short: bool = False) -> None:
    """cut_short: the client hung up mid-stream on purpose (schemathesis stops reading an event
    stream after a number of events), so the stream need not end with [DONE]."""
    assert status < 500, f"{status}: {text[:500]}"
    if status >= 400:
        body = json.loads(text)
        assert is_openai_error(body), text[:500]
        assert "Traceback" not in text
    elif content_type.startswith("text/event-stream"):
        events = text.split("\n\n")
        if not cut_short:
            assert text.endswith("data: [DONE]\n\n"), text[-300:]
            events = events[:-2]
        for event in events:
            if cut_short and (not event or event == "data: [DONE]" or not event.endswith("}")):
                continue  # the tail the client cut
            assert event.startswith("data: "), event[:200]
            payload = json.loads(event[6:])
            if "error" in payload:
                assert is_openai_error(payload), payload
                assert payload["error"]["type"] != "internal_server_error", payload


def assert_idle(srv) -> None:
    deadline = time.monotonic() + 10  # a stream the client just hung up on is aborted a moment later
    while time.monotonic() < deadline and (srv.served.inflight or srv.engine.stats()["kv_blocks_held"]):
        time.sleep(0.05)
    s = srv.engine.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_held"] == 0
    assert srv.served.inflight == 0


# ------------------------------------------------------------------ schema
def test_openapi_schema_is_served_behind_the_key(fuzz_server):
    assert httpx.get(fuzz_server.url + "/openapi.json").status_code == 401
    schema = httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH).json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(schema["components"]["schemas"])


def test_schemathesis(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=AUTH)
    seen: dict[int, int] = {}
    cut_short = [0]  # streams the fuzzing client hung up on: barge-ins, for free
    for result in schema.get_all_operations():
        op = result.ok()
        heavy = op.method.upper() == "POST"
        strategy = st.one_of(op.as_strategy(schemathesis.GenerationMode.POSITIVE),
                             op.as_strategy(schemathesis.GenerationMode.NEGATIVE))

        @settings(max_examples=EXAMPLES if heavy else max(10, EXAMPLES // 6), deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case) -> None:
            headers = {**(case.headers or {}), **AUTH}
            resp = case.call(headers=headers, timeout=60)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            ctype = resp.headers.get("content-type") or [""]
            cut = bool(getattr(resp, "stream_cut_short", False))
            cut_short[0] += cut
            try:
                check_response(resp.status_code, ctype[0] if isinstance(ctype, list) else ctype, resp.text, cut)
            except AssertionError as exc:
                raise AssertionError(f"{case.method} {case.path} headers={case.headers} query={case.query} "
                                     f"body={str(case.body)[:2000]}\n{exc}") from None

        run()
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen  # both kinds were reached
    print(f"statuses {dict(sorted(seen.items()))}, streams cut short by the client: {cut_short[0]}")
    assert_idle(fuzz_server)  # the streams the client hung up on were aborted and freed


# ---------------------------------------------------------- hostile values
MSG = [{"role": "user", "content": "hi"}]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


HOSTILE = [
    # (path, raw JSON body or dict, expected status)
    ("chat", {"messages": MSG, "max_tokens": 10**12}, 400),
    ("chat", {"messages": MSG, "max_tokens": 2**64}, 400),
    ("chat", {"messages": MSG, "max_tokens": 10**400}, 400),
    ("chat", {"messages": MSG, "max_completion_tokens": -1}, 400),
    ("chat", {"messages": MSG, "max_tokens": 0}, 400),
    ("chat", {"messages": MSG, "max_tokens": -5}, 400),
    ("chat", {"messages": MSG, "n": 10**9}, 400),
    ("chat", {"messages": MSG, "n": 0}, 400),
    ("chat", {"messages": MSG, "n": -1}, 400),
    ("chat", {"messages": MSG, "n": 64, "max_tokens": 2}, 400),  # more sequences than the server holds
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 10**6}, 400),
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": -1}, 400),
    ("chat", {"messages": MSG, "logprobs": 5}, 400),
    ("completion", {"prompt": "hi", "logprobs": 10**6}, 400),
    ("completion", {"prompt": "hi", "logprobs": -1}, 400),
    ("completion", {"prompt": "hi", "logprobs": True}, 400),
    ("chat", {"messages": MSG, "stop": ["x"] * 10_000}, 400),
    ("chat", {"messages": MSG, "stop": ""}, 400),
    ("chat", {"messages": MSG, "stop": ["a", 5]}, 400),
    ("chat", {"messages": MSG, "stop": "y" * 50_000, "max_tokens": 4}, 200),  # long, but one string
    ("chat", {"messages": MSG, "stop_token_ids": [-1, 10**18, 2**70], "max_tokens": 4}, 200),  # never match
    ("chat", '{"messages": ' + _deep(100_000) + "}", 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "x": ' + _deep(100_000) + "}", 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "x": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}",
     400),
    ("chat", b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}', 400),
    ("chat", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400),  # a UTF-8 surrogate
    ("chat", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400),  # lone surrogate
    ("chat", b"\xff\xfe{}", 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', 400),
    ("chat", '{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -1e999}', 400),
    ("chat", {"messages": MSG, "temperature": -0.5}, 400),
    ("chat", {"messages": MSG, "top_p": 0}, 400),
    ("chat", {"messages": MSG, "top_k": -7}, 400),
    ("chat", {"messages": MSG, "min_p": -1}, 400),
    ("chat", {"messages": MSG, "repetition_penalty": 0}, 400),
    ("chat", {"messages": MSG, "frequency_penalty": -100}, 400),
    ("chat", {"messages": MSG, "min_tokens": -1}, 400),
    ("chat", {"messages": MSG, "min_tokens": 10**9}, 400),
    ("chat", {"messages": MSG, "seed": 2**64}, 400),
    ("chat", {"messages": MSG, "seed": -(2**70)}, 400),
    ("chat", {"messages": MSG, "seed": -1, "max_tokens": 2}, 200),
    ("chat", {"messages": MSG, "stream": True, "stream_options": {"max_chunk_chars": -1}}, 400),
    ("chat", {"messages": MSG, "stream": True, "stream_options": {"max_chunk_chars": 10**9}}, 400),
    ("chat", {"messages": []}, 400),
    ("chat", {"messages": [{}]}, 400),
    ("chat", {"messages": [{"role": "user"}], "max_tokens": 2}, 200),  # content null: an empty turn
    ("chat", {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}, 200),
    ("chat", {"messages": [{"role": "user", "content": []}], "max_tokens": 2}, 200),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("chat", {"messages": [{"role": "", "content": "hi"}]}, 400),
    ("chat", {"messages": [{"role": "SYSTEM", "content": "hi"}]}, 400),
    ("chat", {"messages": [{"role": None, "content": "hi"}]}, 400),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400),
    ("chat", {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, 400),
    ("chat", {"messages": MSG, "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}"
                                                                         "{% for j in range(99999) %}{% endfor %}"
                                                                         "{% endfor %}"}}, 400),
    ("chat", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400),
    ("chat", {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}, 200),
    ("chat", {"messages": MSG, "chat_template_kwargs": []}, 400),
    ("chat", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400),
    ("chat", {"messages": MSG, "response_format": {"type": ["x"]}}, 400),
    ("chat", {"messages": MSG, "tools": [{"type": "function"}]}, 400),
    ("chat", {"messages": MSG, "model": "../../etc/passwd"}, 404),
    ("chat", {"messages": MSG, "model": "/etc/passwd"}, 404),
    ("chat", {"messages": MSG, "model": ""}, 404),
    ("chat", {"messages": MSG, "model": ["fuzz"]}, 400),
    ("completion", {"prompt": [10**9]}, 400),
    ("completion", {"prompt": [-1]}, 400),
    ("completion", {"prompt": [[1, 2], [2**63]]}, 400),
    ("completion", {"prompt": [2**64]}, 400),
    ("completion", {"prompt": []}, 400),
    ("completion", {"prompt": [[]]}, 400),
    ("completion", {"prompt": ""}, 400),
    ("completion", {"prompt": [1.5]}, 400),
    ("completion", {"prompt": [True]}, 400),
    ("completion", {"prompt": [[1, 2], "x"]}, 400),
    ("completion", {"prompt": ["a"] * 50, "max_tokens": 2}, 400),  # 50 sequences > 16 seats
    ("completion", {"prompt": [1] * 500}, 400),  # past max_model_len
    ("completion", {"prompt": "hi", "echo": True}, 400),
    ("completion", {"prompt": "hi", "best_of": 10**6}, 400),
    ("completion", {"prompt": "hi", "suffix": "x" * 100}, 400),
    ("completion", "[]", 400),
    ("completion", "null", 400),
    ("completion", '"just a string"', 400),
    ("completion", "{", 400),
    ("completion", "", 400),
    ("completion", '{"prompt": "hi", "prompt": [1]}', 200),  # duplicate key: the last one wins
]


@pytest.mark.parametrize("path, body, status", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_values(fuzz_server, path, body, status):
    url = fuzz_server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    if isinstance(body, dict):
        content = json.dumps({"model": "fuzz", **body}).encode()
    else:
        content = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    r = httpx.post(url, content=content, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    check_response(r.status_code, r.headers.get("content-type", ""), r.text)
    assert r.status_code == status, r.text[:500]
    assert fuzz_server.served.inflight == 0


def raw_http(port: int, data: bytes) -> tuple[int | None, bytes]:
    """Send raw bytes; the status code of the answer (None if the server just closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks):
                    break
        except (TimeoutError, ConnectionResetError):
            pass  # e.g. chunked framing that never completes: the server is still waiting for it
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/1.1 "):
        return None, raw
    return int(raw[9:12]), raw


def test_hostile_headers_and_paths(fuzz_server):
    url, port = fuzz_server.url, fuzz_server.port
    body = b'{"prompt": "hi", "max_tokens": 1}'
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    for extra in (b"Content-Type: text/plain\r\nContent-Length: 33\r\n",
                  b"Content-Type: application/json; charset=latin-1\r\nContent-Length: 33\r\n",
                  b"Content-Length: -1\r\n", b"Content-Length: 99999999999999999999\r\n",
                  b"Content-Length: 5\r\nContent-Length: 33\r\n",
                  b"Transfer-Encoding: chunked\r\nContent-Length: 33\r\n",
                  b"Transfer-Encoding: gzip\r\n", b"Content-Length: 33\r\nX-Bad\x00Header: 1\r\n"):
        status, raw = raw_http(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + extra
                               + b"Connection: close\r\n\r\n" + body)
        assert status is None or status < 500, (extra, raw[:300])
    for path in ("/v1/models/..%2f..%2fetc%2fpasswd", "/v1/models/%00", "/v1/models/" + "a" * 5000,
                 "/v1/../../etc/passwd", "/v1/chat/completions/../completions"):
        r = httpx.get(url + path, headers=AUTH, timeout=30)
        assert r.status_code in (400, 404, 405), (path, r.status_code)
        assert is_openai_error(r.json()), r.text
    # the server is fine after all of it
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, headers=AUTH, timeout=30)
    assert r.status_code == 200
    assert_idle(fuzz_server)
