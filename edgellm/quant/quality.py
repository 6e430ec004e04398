"""The quality report: perplexity of source and quantized model on held-out text,
computed by edgellm's own engine (LLM.prompt_logits), plus logit agreement.

The quantized checkpoint is loaded with LLM(OUT) when the engine supports its
format. Until it does, the checkpoint is read back from disk with the exact
unpackers (edgellm/kernels/int4_layouts.py, export.dequantize_module) into a float32
HF directory and that is loaded instead: weight quantization is measured
exactly; activation quantization (W8A8, FP8 inputs) and the FP8 KV cache are
not simulated on that path. The report says which path ran.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from edgellm.quant.export import dequantize_module

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer and generation files, copied as regular files (symlinks are read through)."""
    copied = []
    for name in TOKENIZER_FILES:
        p = src / name
        if p.is_file():
            shutil.copyfile(p, dst / name)
            copied.append(name)
    return copied


def _safetensors_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.safetensors") if p.name != "reference.safetensors")


def dequantize_checkpoint(src: Path, dst: Path) -> None:
    """A quantized checkpoint -> float32 HF directory (no quantization_config)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    by_module: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    plain: dict[str, torch.Tensor] = {}
    quant_params = {
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_g_idx",
        "input_scale",
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "k_scale",
        "v_scale",
    }
    for f in _safetensors_files(src):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                module, _, param = name.rpartition(".")
                by_module[module][param] = h.get_tensor(name)
    for module, tensors in by_module.items():
        if "k_scale" in tensors or "v_scale" in tensors:
            tensors.pop("k_scale", None)
            tensors.pop("v_scale", None)
        w = dequantize_module(tensors, qc) if set(tensors) & quant_params else None
        if w is not None:
            plain[f"{module}.weight"] = w.float().contiguous()
            if "bias" in tensors:
                plain[f"{module}.bias"] = tensors["bias"].float()
            continue
        for param, t in tensors.items():
            if param in quant_params:
                continue
            plain[f"{module}.{param}"] = t.float() if t.is_floating_point() else t
    dst.mkdir(parents=True, exist_ok=True)
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    copy_side_files(src, dst)


def _open_llm(path: Path, max_len: int) -> Any:
    from edgellm.llm import LLM

    return LLM(
        str(path),
        dtype="float32",
        kv_cache_memory=64 << 20,
        max_model_len=max_len,
        enable_prefix_caching=False,
    )


def open_quantized(out_dir: Path, work_dir: Path, max_len: int) -> tuple[Any, str]:
    """LLM over the quantized checkpoint: the engine's own loader, else the read-back float copy."""
    try:
        return _open_llm(out_dir, max_len), "engine"
    except Exception as exc:  # the engine may not load this format yet
        logger.info(
            "edgellm cannot load %s directly (%s); evaluating its exact float read-back",
            out_dir.name,
            str(exc).splitlines()[0][:160],
        )
    deq = work_dir / "dequantized"
    dequantize_checkpoint(out_dir, deq)
    return _open_llm(deq, max_len), "dequantized"


def compare(src_llm: Any, q_llm: Any, held_out: list[list[int]]) -> dict[str, float]:
    """Perplexities and logit agreement over the held-out windows, one window at a time."""
    nll_s = nll_q = 0.0
    tokens = 0
    diff2 = ref2 = 0.0
    kl = 0.0
    agree = 0
    positions = 0
    for ids in held_out:
        ls = src_llm.prompt_logits([ids])[0].float()
        lq = q_llm.prompt_logits([ids])[0].float()
        target = torch.tensor(ids[1:])
        nll_s += float(F.cross_entropy(ls[:-1], target, reduction="sum"))
        nll_q += float(F.cross_entropy(lq[:-1], target, reduction="sum"))
        tokens += len(ids) - 1
        diff2 += float((lq - ls).pow(2).sum())
        ref2 += float(ls.pow(2).sum())
        lps, lpq = F.log_softmax(ls, -1), F.log_softmax(lq, -1)
        kl += float((lps.exp() * (lps - lpq)).sum())
        agree += int((ls.argmax(-1) == lq.argmax(-1)).sum())
        positions += ls.shape[0]
    ppl_s, ppl_q = math.exp(nll_s / tokens), math.exp(nll_q / tokens)
    return {
        "perplexity_source": ppl_s,
        "perplexity_quantized": ppl_q,
        "perplexity_relative_change": ppl_q / ppl_s - 1.0,
        "logit_relative_error": math.sqrt(diff2 / max(ref2, 1e-30)),
        "mean_kl_divergence": kl / positions,
        "top1_agreement": agree / positions,
        "eval_tokens": tokens,
        "eval_windows": len(held_out),
    }


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def weights_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in _safetensors_files(path))
