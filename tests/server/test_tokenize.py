"""vLLM's POST /tokenize, as token-aware routers (vllm-router's cache_aware) call it: a chat's ids
are the ones its chat completion is served with (template and tools applied), a prompt's the
tokenizer's (special tokens unless add_special_tokens is false); bad bodies are OpenAI-shaped 400s
and an unknown model a 404."""

from __future__ import annotations

import time

import httpx
import pytest

from edgellm.cli import build_parser
from edgellm.server.launch import select_spec, serving_app
from tests.helpers.serverutil import ThreadServer, build_tiny_chat_model, is_openai_error

CHAT = [{"role": "system", "content": "You are a ship's navigator. Answer in one sentence."},
        {"role": "user", "content": "Where is the nearest harbour?"}]
TOOLS = [{"type": "function", "function": {"name": "find_harbour", "description": "Nearest harbour",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    args = build_parser().parse_args(["serve", "--model", str(model), "--kv-cache-memory", "16M",
                                      "--max-model-len", "256", "--served-model-name", "tiny"])
    app, served = serving_app(args, select_spec(args), None)
    with ThreadServer(app) as srv:
        deadline = time.monotonic() + 180
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        yield srv, served
    served.engine.shutdown()


def tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body, timeout=60)


def test_chat_ids_are_the_served_prompt(server):
    srv, served = server
    r = tokenize(srv.url, {"model": "tiny", "messages": CHAT})
    assert r.status_code == 200, r.text
    out = r.json()
    tok = served.engine.tokenizer
    assert out["tokens"] == tok.encode_chat(CHAT)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256 and out["token_strs"] is None
    done = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": CHAT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == out["count"]
    # tools go into the prompt as on /v1/chat/completions; without a generation prompt it is shorter
    with_tools = tokenize(srv.url, {"messages": CHAT, "tools": TOOLS}).json()
    assert with_tools["count"] > out["count"] and "find_harbour" in tok.decode(with_tools["tokens"])
    bare = tokenize(srv.url, {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tok.encode_chat(CHAT, add_generation_prompt=False) != out["tokens"]


def test_prompt_ids_with_and_without_special_tokens(server):
    srv, served = server
    tok = served.engine.tokenizer
    text = "The harbour lights came on one by one."
    out = tokenize(srv.url, {"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode(text)
    assert out["token_strs"] == tok.hf.convert_ids_to_tokens(out["tokens"])
    plain = tokenize(srv.url, {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "a", "messages": CHAT}, 400, None),
    ({}, 400, None),
    ({"prompt": [1, 2, 3]}, 400, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ({"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, None),
    ({"model": "other", "prompt": "a"}, 404, "model"),
])
def test_bad_bodies_are_openai_errors(server, body, status, param):
    srv, _ = server
    r = tokenize(srv.url, body)
    assert r.status_code == status, r.text
    assert is_openai_error(r.json())
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert httpx.post(srv.url + "/tokenize", content=b"{not json", timeout=30).status_code == 400
