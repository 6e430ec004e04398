"""Where `edgellm convert` reads from: an HF safetensors directory, a .gguf file, or
`default` (the embedded SmolLM2-135M-Instruct GGUF). GGUF sources are dequantized
once to an fp16 HF directory (config.json, model.safetensors, tokenizer) and cached
under $EDGELLM_CACHE/gguf-hf/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from edgellm import env

CONVERT_ARCHS = ("llama", "mistral", "qwen2", "phi3", "qwen3", "gemma3", "exaone4")


class ConvertError(ValueError):
    """A bad input or a failed conversion; the message is one line."""


def _cache_dir() -> Path:
    return env.cache_dir()


def gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Dequantize a GGUF into an HF directory (config.json, model.safetensors, tokenizer)."""
    from safetensors.torch import save_file

    from edgellm.quant.gguf import GGUFCheckpoint
    from edgellm.tokenizer import Tokenizer

    ckpt = GGUFCheckpoint(gguf_path)
    cfg = dict(ckpt.config)
    cfg.pop("torch_dtype", None)
    cfg.pop("quantization_config", None)  # the output is dequantized: a float checkpoint
    classes = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    cfg.update(
        architectures=[classes[cfg["model_type"]]],
        hidden_act="silu",
        dtype=str(dtype).removeprefix("torch."),
        rope_parameters=None,
    )
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if "rope_scaling" in cfg:
        cfg["rope_parameters"].update(cfg.pop("rope_scaling"))
    tensors = {}
    for name, t in tqdm(
        ckpt.tensors(keep_quantized=False),
        desc="dequantize gguf",
        total=len(ckpt.reader.tensors),
        leave=False,
    ):
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        tensors[name] = t.to(dtype).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok = Tokenizer.load(gguf_path, "gguf")
    if tok is not None:
        tok.hf.save_pretrained(str(out_dir))
    return out_dir


def resolve_source(src: str) -> tuple[Path, str]:
    """SRC -> (HF directory, description). GGUF sources are converted once and cached."""
    from edgellm.loader import default_model_path

    if src == "default" or src.endswith(".gguf"):
        try:
            path = default_model_path() if src == "default" else Path(src).expanduser()
        except ValueError as exc:
            raise ConvertError(str(exc)) from None
        if not path.is_file():
            raise ConvertError(f"{src}: GGUF file not found")
        st = path.stat()
        key = hashlib.sha256(
            f"v3|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
        ).hexdigest()[:16]
        cached = _cache_dir() / "gguf-hf" / key
        if not (cached / "model.safetensors").is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cached.parent))
            try:
                gguf_to_hf(path, tmp)
                os.replace(tmp, cached)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return cached, f"{path.name} (GGUF dequantized to fp16)"
    path = Path(src).expanduser()
    if not path.is_dir():
        raise ConvertError(
            f"{src}: not a checkpoint (give an HF directory, a .gguf file or 'default')"
        )
    if not (path / "config.json").is_file() or not safetensors_files(path):
        raise ConvertError(
            f"{src}: not an HF checkpoint (needs config.json and *.safetensors weights)"
        )
    return path, str(path)


def safetensors_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.name != "reference.safetensors")


def check_source_config(src: Path) -> dict[str, Any]:
    from edgellm.models.arch import resolve_architecture

    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{src}/config.json: not valid JSON ({exc})") from None
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ConvertError(f"{src}: already quantized ({method}); convert needs a float checkpoint")
    try:
        arch = resolve_architecture(config)
    except ValueError as exc:
        raise ConvertError(str(exc)) from None
    if arch.name not in CONVERT_ARCHS:
        raise ConvertError(
            f"unsupported architecture for convert: {arch.name} (supported: "
            f"{', '.join(CONVERT_ARCHS)})"
        )
    return config
