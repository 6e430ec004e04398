"""models.yaml: parsing, validation errors, and `edgellm models`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edgellm.cli import main
from edgellm.registry import RegistryError, load_registry
from edgellm.server.launch import select_spec, warm_prompt_ids

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "models.yaml"
    p.write_text(text)
    return p


def test_repo_registry_is_valid():
    specs = load_registry(REPO / "models.yaml")
    assert "smollm2-135m-instruct" in specs
    assert specs["smollm2-135m-instruct"].source == "default"
    assert specs["smollm2-135m-instruct"].model_arg is None


def test_full_entry(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    p = write(tmp_path, """
models:
  voice:
    source: m.gguf
    architecture: llama
    quantization: GGUF
    kv_cache_dtype: fp8
    max_model_len: 2048
    chat_template: t.jinja
    warm_prompts: ["You are nice."]
  inline:
    source: default
    chat_template: "{% for m in messages %}{{ m.content }}{% endfor %}"
  short: m.gguf
""")
    specs = load_registry(p)
    assert list(specs) == ["voice", "inline", "short"]
    v = specs["voice"]
    assert v.source == str(tmp_path / "m.gguf")  # relative to the YAML file
    assert v.architecture == "llama" and v.quantization == "gguf" and v.kv_cache_dtype == "fp8"
    assert v.max_model_len == 2048 and v.warm_prompts == ["You are nice."]
    assert v.chat_template == str(tmp_path / "t.jinja")
    assert specs["inline"].chat_template.startswith("{% for")
    assert specs["short"].source == str(tmp_path / "m.gguf")


@pytest.mark.parametrize("body, needle", [
    ("models:\n  a:\n    source: default\n    max_len: 5\n", "unknown key 'max_len'"),
    ("models:\n  a:\n    architecture: llama\n", "missing key 'source'"),
    ("models:\n  a:\n    source: nope.gguf\n", "source not found"),
    ("models:\n  a:\n    source: default\n    chat_template: missing.jinja\n", "chat_template file not found"),
    ("models:\n  a:\n    source: default\n    max_model_len: '4096'\n", "max_model_len must be an integer"),
    ("models:\n  a:\n    source: default\n    max_model_len: 0\n", "max_model_len must be a positive"),
    ("models:\n  a:\n    source: default\n    quantization: int3\n", "quantization must be one of"),
    ("models:\n  a:\n    source: default\n    kv_cache_dtype: int8\n", "kv_cache_dtype must be one of auto, fp32"),
    ("models:\n  a:\n    source: default\n    architecture: gpt2\n", "unknown architecture 'gpt2'"),
    ("models:\n  a:\n    source: default\n    warm_prompts: hello\n", "warm_prompts must be a list"),
    ("models:\n  a:\n    source: default\n    warm_prompts: ['']\n", "non-empty strings"),
    ("models:\n  'bad name':\n    source: default\n", "bad served name"),
    ("model:\n  a:\n    source: default\n", "unknown top-level key 'model'"),
    ("models: [1, 2]\n", "'models' must be a mapping"),
    ("models:\n  a: [1]\n", "expected a mapping"),
    ("models: {a: {source: default}\n", "not valid YAML"),
])
def test_errors_name_the_problem(tmp_path, body, needle):
    p = write(tmp_path, body)
    with pytest.raises(RegistryError) as info:
        load_registry(p)
    assert needle in str(info.value)
    assert str(p) in str(info.value)


def test_missing_registry_file(tmp_path):
    with pytest.raises(RegistryError, match="not found"):
        load_registry(tmp_path / "nope.yaml")


def test_quantization_must_match_the_checkpoint(tmp_path):
    specs = load_registry(write(tmp_path, "models:\n  a: {source: default, quantization: awq}\n"
                                          "  b: {source: default, quantization: gguf}\n"))
    with pytest.raises(RegistryError, match="says quantization 'awq' but .* is 'gguf'"):
        specs["a"].check_quantization()
    assert specs["b"].check_quantization() == "gguf"


def _serve_args(**kw):
    ns = argparse.Namespace(config=None, model=None)
    ns.__dict__.update(kw)
    return ns


def test_select_spec(tmp_path, monkeypatch):
    p = write(tmp_path, "models:\n  other: {source: default, max_model_len: 64}\n"
                        "  mine: {source: default, max_model_len: 128}\n")
    assert select_spec(_serve_args(config=str(p), model="mine")).max_model_len == 128
    # no --model: the registry's entry for the embedded default (the first)
    assert select_spec(_serve_args(config=str(p))).name == "other"
    # a path that is neither a served name nor a file
    with pytest.raises(RegistryError, match="neither a served name"):
        select_spec(_serve_args(config=str(p), model="/no/such/model"))
    # no registry anywhere: the embedded default under its usual name
    monkeypatch.chdir(tmp_path / "..")
    assert select_spec(_serve_args()).name == "smollm2-135m-instruct"


def test_edgellm_models_lists_and_flags_missing(tmp_path, capsys):
    good = write(tmp_path, "models:\n  a: {source: default, warm_prompts: [x, y]}\n")
    assert main(["models", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "a" in out and "default" in out and "ok" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  a: {source: default}\n  b: {source: gone.gguf}\n")
    assert main(["models", "--config", str(bad)]) == 1
    assert "source not found" in capsys.readouterr().out
    bad.write_text("models:\n  a: {source: default, colour: red}\n")
    assert main(["models", "--config", str(bad)]) == 2
    assert "unknown key 'colour'" in capsys.readouterr().err


class _Tok:
    """A character-level stand-in with a ChatML template."""

    class hf:
        chat_template = "chatml"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages):
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages) + "<assistant>"
        return self.encode(text)


def test_warm_prompt_ids_are_the_shared_prefix():
    ids = warm_prompt_ids(_Tok(), "Be brief.")
    text = "".join(map(chr, ids))
    assert text == "<system>Be brief.</s><user>"


def test_quantization_of_an_hf_directory(tmp_path):
    (tmp_path / "awq").mkdir()
    (tmp_path / "awq" / "config.json").write_text('{"quantization_config": {"quant_method": "awq", "bits": 4}}')
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "llama"}')
    specs = load_registry(write(tmp_path, "models:\n  a: {source: awq, quantization: awq}\n"
                                          "  b: {source: plain, quantization: gptq}\n"
                                          "  c: {source: plain}\n"))
    assert specs["a"].check_quantization() == "awq"
    with pytest.raises(RegistryError, match="says quantization 'gptq' but .* is 'none'"):
        specs["b"].check_quantization()
    assert specs["c"].check_quantization() == "none"


def test_chat_template_override_text(tmp_path):
    from edgellm.server.launch import _template_text

    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert _template_text(inline) == inline
    f = tmp_path / "t.jinja"
    f.write_text(inline + "!")
    assert _template_text(str(f)) == inline + "!"
    assert _template_text(None) is None
    with pytest.raises(RegistryError, match="not found"):
        _template_text(str(tmp_path / "missing.jinja"))
