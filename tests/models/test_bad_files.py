"""Bad model files: each is a clear error naming the file and the problem, never a traceback from
`edgellm serve`, and never anything a running server can be made to load. (test_errors.py covers
a truncated safetensors file, config.json that is not JSON, an unknown architecture and an
unsupported quantization_config through the offline API; here: headers that lie, GGUF files, and
the same failures at `edgellm serve` start-up.)"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from edgellm import LLM
from edgellm.config import EngineConfig
from edgellm.engine.async_engine import AsyncEngine
from edgellm.loader import default_model_path
from edgellm.server.app import create_app
from edgellm.server.served_model import ServedModel
from tests.helpers.serverutil import ThreadServer, free_port


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return tiny_dir("llama")[0]


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_header(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_with_header(f: Path, header: dict, data: bytes, pad_to: int | None = None) -> None:
    h = json.dumps(header).encode()
    if pad_to is not None:
        h = h.ljust(pad_to, b" ")
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def load_error(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(path), kv_cache_memory=1 << 20)
    return str(info.value)


def first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


# ------------------------------------------------------------- safetensors
def test_header_offsets_past_the_end(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    name = first_tensor(header)
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 10**9]
    write_with_header(f, header, data)
    msg = load_error(d)
    assert str(f) in msg and "corrupt safetensors" in msg


def test_header_shape_disagrees_with_offsets(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    name = first_tensor(header)
    header[name]["shape"] = [s * 2 for s in header[name]["shape"]]
    write_with_header(f, header, data)
    msg = load_error(d)
    assert str(f) in msg and "corrupt safetensors" in msg


def test_header_shape_that_fits_but_is_wrong(llama, tmp_path):
    """Same byte count, transposed shape: safetensors cannot tell, the loader must."""
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    name = next(k for k, v in header.items() if k.endswith("mlp.down_proj.weight"))
    rows, cols = header[name]["shape"]
    header[name]["shape"] = [cols, rows]
    write_with_header(f, header, data)
    msg = load_error(d)
    assert str(f) in msg and name in msg and str((cols, rows)) in msg


def test_header_overlapping_offsets(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    names = [k for k in header if k != "__metadata__"]
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    write_with_header(f, header, data)
    msg = load_error(d)
    assert str(f) in msg


@pytest.mark.parametrize("damage", ["huge_header_length", "header_not_json", "unknown_dtype", "empty_file"])
def test_broken_safetensors_header(llama, tmp_path, damage):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    if damage == "huge_header_length":
        raw = f.read_bytes()
        f.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    elif damage == "header_not_json":
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        f.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    elif damage == "unknown_dtype":
        header[first_tensor(header)]["dtype"] = "F19"
        write_with_header(f, header, data)
    else:
        f.write_bytes(b"")
    msg = load_error(d)
    assert str(f) in msg and "corrupt safetensors" in msg


def test_config_json_missing_a_key_names_the_file(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = load_error(d)
    assert str(d) in msg and "hidden_size" in msg


def test_unknown_architecture_names_the_file(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mamba", ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = load_error(d)
    assert str(d) in msg and "mamba" in msg


def test_unsupported_quantization_names_the_file(llama, tmp_path):
    d = copy_ckpt(llama, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitnet", "bits": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    msg = load_error(d)
    assert str(d) in msg and "bitnet" in msg


# -------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return default_model_path().read_bytes()


@pytest.mark.parametrize("damage, problem", [
    ("wrong_magic", "not a readable GGUF"),
    ("cut_in_header", "not a readable GGUF"),
    ("cut_in_tensor_data", "not a readable GGUF"),  # gguf-py fails at open, before edgellm's size check
    ("empty", "not a readable GGUF"),
])
def test_bad_gguf(tmp_path, gguf_bytes, damage, problem):
    f = tmp_path / "model.gguf"
    if damage == "wrong_magic":
        f.write_bytes(b"GGUX" + gguf_bytes[4:1 << 20])
    elif damage == "cut_in_header":
        f.write_bytes(gguf_bytes[:200])
    elif damage == "cut_in_tensor_data":
        f.write_bytes(gguf_bytes[: len(gguf_bytes) * 2 // 3])
    else:
        f.write_bytes(b"")
    msg = load_error(f)
    assert str(f) in msg and problem in msg, msg


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x80\x04pickle")
    msg = load_error(f)
    assert str(f) in msg and ".gguf" in msg


# ------------------------------------------------------- edgellm serve
def serve_fails(args: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "Traceback" not in out, out[-4000:]
    return out


def test_serve_with_bad_model_files_fails_with_a_message(llama, tmp_path, gguf_bytes):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[: len(gguf_bytes) // 2])
    out = serve_fails(["--model", str(cut)], tmp_path)
    assert str(cut) in out and "not a readable GGUF" in out
    d = copy_ckpt(llama, tmp_path / "ckpt")
    f = d / "model.safetensors"
    header, data = read_header(f)
    header[first_tensor(header)]["data_offsets"] = [0, 10**12]
    write_with_header(f, header, data)
    out = serve_fails(["--model", str(d)], tmp_path)
    assert str(f) in out and "corrupt safetensors" in out


BAD_YAML = [
    ("models:\n  m:\n    source: default\n    colour: blue\n", "unknown key 'colour'"),
    ("models:\n  m:\n    source: ./nowhere.gguf\n", "source not found"),
    ("models:\n  m:\n    source: default\n    max_model_len: lots\n", "max_model_len must be an integer"),
    ("models:\n  m:\n    source: default\n    quantization: hqq\n", "quantization must be one of"),
    ("models:\n  m: [1, 2]\n", "expected a mapping"),
    ("models:\n  m:\n    source: default\n   bad indent: 1\n", "not valid YAML"),
    ("models: [m]\n", "'models' must be a mapping"),
    ("models:\n  ../../etc: {source: default}\n", "bad served name"),
]


@pytest.mark.parametrize("yaml_text, needle", BAD_YAML)
def test_bad_models_yaml_is_a_message_naming_file_and_key(tmp_path, yaml_text, needle):
    from edgellm.registry import RegistryError
    from edgellm.server.launch import select_spec

    cfg = tmp_path / "models.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(RegistryError) as info:
        select_spec(argparse.Namespace(config=str(cfg), model="m"))
    assert needle in str(info.value) and str(cfg) in str(info.value), str(info.value)


def test_bad_models_yaml_fails_serve_start_up_without_a_traceback(tmp_path, gguf_bytes):
    cfg = tmp_path / "models.yaml"
    cfg.write_text(BAD_YAML[0][0])
    out = serve_fails(["--config", str(cfg), "--model", "m"], tmp_path)
    assert "unknown key 'colour'" in out and str(cfg) in out
    (tmp_path / "cut.gguf").write_bytes(gguf_bytes[:300_000])  # an entry whose file is bad
    cfg.write_text("models: {m: {source: cut.gguf}}\n")
    out = serve_fails(["--config", str(cfg), "--model", "m"], tmp_path)
    assert str(tmp_path / "cut.gguf") in out and "not a readable GGUF" in out


# -------------------------------------------- a running server loads nothing
def test_running_server_never_loads_a_file_named_in_a_request(llama, tmp_path, gguf_bytes):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[:1000])
    engine = AsyncEngine(EngineConfig(model=str(llama), kv_cache_memory=1 << 20, max_model_len=64))
    try:
        with ThreadServer(create_app([ServedModel(names=["tiny"], engine=engine, max_waiting_requests=4)])) as srv:
            for name in (str(cut), str(llama), "default", "./cut.gguf", "file://" + str(cut)):
                r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        engine.shutdown()
