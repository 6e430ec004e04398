"""Security: the API key guards every route but /health (and /metrics unless public), compared in
constant time; `model` only ever names a served model; default bind is loopback; header and body
size limits hold on the real uvicorn configuration; nothing unpickles, and a checkpoint cannot run
its own code. (test_server_guard.py has the key and body-limit basics; this extends them.)"""

from __future__ import annotations

import argparse
import ast
import hmac
import json
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import uvicorn

from edgellm.server import guard as guard_module
from edgellm.server import launch
from edgellm.server.app import ServerSettings, create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.scripted_engine import OK, ScriptedEngine
from tests.helpers.serverutil import is_openai_error

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-security-tests"


class LaunchedServer:
    """The app under the exact uvicorn configuration `edgellm serve` uses (launch.uvicorn_config)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.engine = ScriptedEngine()
        self.served = ServedModel(names=["scripted"], engine=self.engine, max_waiting_requests=4)
        self.app = create_app([self.served], settings)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = argparse.Namespace(host="127.0.0.1", port=self.port, uvicorn_log_level="warning", access_log=False)
        self.server = uvicorn.Server(launch.uvicorn_config(self.app, args))
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LaunchedServer:  # noqa: PYI034
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def keyed():
    with LaunchedServer(ServerSettings(api_key=KEY, max_body_bytes=4096)) as srv:
        yield srv


def routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the app has, now and as it grows."""
    out = []
    for route in app.routes:
        path = re.sub(r"\{[^}]+\}", "scripted", getattr(route, "path", ""))
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, path))
    return out


# -------------------------------------------------------------- API key
def test_every_route_but_health_needs_the_key(keyed):
    found = routes(keyed.app)
    paths = {p for _, p in found}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
            "/openapi.json"} <= paths, paths
    for method, path in found + [("GET", "/nope"), ("DELETE", "/v1/models"), ("OPTIONS", "/v1/completions")]:
        r = httpx.request(method, keyed.url + path, json={"prompt": [OK], "max_tokens": 2})
        if path == "/health":
            assert r.status_code == 200
            continue
        assert r.status_code == 401, (method, path, r.status_code)
        assert is_openai_error(r.json()) and r.headers["www-authenticate"] == "Bearer"
        r = httpx.request(method, keyed.url + path, json={"prompt": [OK], "max_tokens": 2},
                          headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code != 401, (method, path)


def test_metrics_public_opens_metrics_only():
    with LaunchedServer(ServerSettings(api_key=KEY, metrics_public=True)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        for method, path in routes(srv.app):
            if path not in ("/metrics", "/health"):
                assert httpx.request(method, srv.url + path).status_code == 401, path


def test_key_is_compared_in_constant_time(keyed, monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    for token in ("-", "x", KEY[:-1], KEY + "x", KEY.upper(), KEY):
        httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert len(calls) == 6 and all(b == KEY.encode() for _, b in calls)
    # and nothing else in the guard compares the key: no ==, !=, startswith or `in` on it
    src = Path(guard_module.__file__).read_text()
    guard = ast.get_source_segment(src, next(n for n in ast.parse(src).body
                                            if isinstance(n, ast.ClassDef) and n.name == "Guard"))
    assert "compare_digest(token, self.key)" in guard
    assert not re.search(r"self\.key\s*(==|!=)|(==|!=)\s*self\.key|in self\.key", guard)


@pytest.mark.parametrize("header", [
    {"Authorization": f"bearer {KEY}"}, {"Authorization": f"BEARER   {KEY}"},
])
def test_bearer_scheme_is_case_insensitive(keyed, header):
    assert httpx.get(keyed.url + "/v1/models", headers=header).status_code == 200


@pytest.mark.parametrize("header", [
    {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"X-API-Key": KEY},
    {"Authorization": f"Bearer {KEY}\x00"}, {"Authorization": f"Bearer {KEY},{KEY}"},
])
def test_wrong_key_forms_are_refused(keyed, header):
    try:
        r = httpx.get(keyed.url + "/v1/models", headers=header)
    except (httpx.HTTPError, ValueError):
        return  # the client will not even send it
    assert r.status_code in (400, 401)


def test_key_is_checked_before_anything_is_read_or_parsed(keyed):
    r = httpx.post(keyed.url + "/v1/completions", content=b"x" * 10_000)  # over the body limit, no key
    assert r.status_code == 401
    r = httpx.post(keyed.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 401


# ------------------------------------------------------------ model name
def test_model_selects_only_served_names(keyed, tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    for name in (str(f), "../../etc/passwd", "/etc/passwd", "default", "scripted/../scripted", "SCRIPTED",
                 " scripted", "file:///etc/passwd", "~/model.gguf"):
        r = httpx.post(keyed.url + "/v1/completions", headers=auth,
                       json={"model": name, "prompt": [OK], "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", name
        assert "Traceback" not in r.text
        r = httpx.get(keyed.url + "/v1/models/" + quote(name, safe=""), headers=auth)
        assert r.status_code == 404, name


# ----------------------------------------------------------------- bind
def test_default_bind_is_loopback_and_wide_bind_warns(caplog, monkeypatch):
    from edgellm.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
    monkeypatch.delenv("EDGELLM_API_KEY", raising=False)

    def stop(_args):
        raise SystemExit(0)

    monkeypatch.setattr(launch, "select_spec", stop)
    for host, warns in (("::", True), ("0.0.0.0", True), ("10.1.2.3", True), ("127.0.0.1", False),
                        ("::1", False), ("localhost", False)):
        caplog.clear()
        with pytest.raises(SystemExit):
            launch.serve(argparse.Namespace(api_key=None, host=host))
        assert ("without --api-key" in caplog.text) == warns, host
    monkeypatch.setenv("EDGELLM_API_KEY", "from-env")
    caplog.clear()
    with pytest.raises(SystemExit):
        launch.serve(argparse.Namespace(api_key=None, host="0.0.0.0"))
    assert "without --api-key" not in caplog.text


# ---------------------------------------------------------- size limits
def raw_status(port: int, data: bytes) -> int | None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
        except (ConnectionResetError, BrokenPipeError):
            pass  # refused before we finished sending: the answer may still be readable
        try:
            head = sock.recv(4096)
        except (ConnectionResetError, TimeoutError):
            return None
    return int(head[9:12]) if head.startswith(b"HTTP/1.1 ") else None


def test_header_size_limit(keyed):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    ok = raw_status(keyed.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth
                    + b"X-Pad: " + b"a" * 8000 + b"\r\nConnection: close\r\n\r\n")
    assert ok == 200
    for size in (launch.MAX_HEADER_BYTES + 100, 200_000, 4_000_000):
        big = raw_status(keyed.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth
                         + b"X-Pad: " + b"a" * size + b"\r\n\r\n")
        assert big in (400, 431, None), size
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 30) for i in range(1000))
    assert raw_status(keyed.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + many + b"\r\n") in (400, 431, None)
    long_line = raw_status(keyed.port, b"GET /v1/models?" + b"q" * (launch.MAX_HEADER_BYTES + 100)
                           + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
    assert long_line in (400, 414, 431, None)
    # still serving
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_body_size_limit_holds_for_lying_and_missing_lengths(keyed):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    # declared too big: refused from the header, before any body is read
    assert raw_status(keyed.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
                      + b"Content-Length: 999999999\r\n\r\n") == 413
    # chunked, no length: refused while reading
    chunk = b"1000\r\n" + b" " * 4096 + b"\r\n"
    assert raw_status(keyed.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
                      + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 3) == 413


# -------------------------------------------------------------- pickle
_UNSAFE = [
    (r"\bpickle\.loads?\(", "pickle.load"), (r"\bcPickle\b", "cPickle"), (r"\bdill\.loads?\(", "dill"),
    (r"\bjoblib\.load\(", "joblib.load"), (r"allow_pickle\s*=\s*True", "numpy allow_pickle"),
    (r"\byaml\.load\(", "yaml.load (use safe_load)"), (r"\byaml\.unsafe_load\(", "yaml.unsafe_load"),
    (r"\bmarshal\.loads?\(", "marshal"), (r"\bshelve\.open\(", "shelve"),
    (r"trust_remote_code\s*=\s*True", "trust_remote_code"),
]


def _python_files() -> list[Path]:
    out = []
    for top in ("edgellm", "benchmarks", "tests"):
        out += sorted((ROOT / top).rglob("*.py"))
    return out


def test_nothing_unpickles():
    """torch.load only with weights_only=True; no pickle, dill, joblib, numpy pickles, unsafe YAML or
    remote code anywhere in the project."""
    problems = []
    for f in _python_files():
        src = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for pattern, what in _UNSAFE:
            for m in re.finditer(pattern, src):
                line = src.count("\n", 0, m.start()) + 1
                if f.name != "test_security.py":
                    problems.append(f"{rel}:{line}: {what}")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    problems.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
    assert not problems, "\n".join(problems)


def test_a_checkpoint_cannot_run_its_own_code(tiny_dir, tmp_path):
    """A tokenizer_config.json whose auto_map points at Python in the checkpoint must not import it."""
    import shutil

    from edgellm import LLM

    src = tiny_dir("llama")[0]
    d = tmp_path / "evil"
    shutil.copytree(src, d)
    marker = tmp_path / "pwned"
    (d / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                   "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]},
         "tokenizer_class": "EvilTokenizer"}))
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil_tok.EvilModel", "AutoConfig": "evil_tok.EvilConfig"}
    (d / "config.json").write_text(json.dumps(cfg))
    try:
        LLM(str(d), kv_cache_memory=1 << 20)
    except (ValueError, OSError):
        pass  # refusing is fine; running the code is not
    assert not marker.exists()


def test_server_writes_no_files():
    """Nothing a request does can write a file: no open(..., 'w'/'a') anywhere in the server.
    (`edgellm convert`'s own output safety, symlinks out of OUT and atomic writes, is tested with
    convert.)"""
    for f in (ROOT / "edgellm" / "server").glob("*.py"):
        src = f.read_text()
        assert not re.search(r"open\([^)]*['\"][wa]b?['\"]", src), f
