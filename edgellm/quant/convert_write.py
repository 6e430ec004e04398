"""Writing the output of `edgellm convert`: the state dict, the checkpoint, the move into OUT.

build_state_dict: the source's tensors in the source's order, each quantized linear
replaced by its on-disk tensors (and FP8 KV-cache scales added); write_checkpoint:
config.json with quantization_config, model.safetensors and the source's side files into
a temp dir; install: that dir renamed to OUT (an existing OUT replaced only with --force).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from edgellm.quant.convert_source import ConvertError, safetensors_files
from edgellm.quant.export import Scheme, linear_tensors
from edgellm.quant.qparams import FP8Weight, IntWeight, round_scale
from edgellm.quant.quality import copy_side_files


def build_state_dict(
    model: nn.Module,
    src: Path,
    results: dict[str, IntWeight | FP8Weight],
    scheme: Scheme,
    fmt: str,
    dtype: torch.dtype,
    kv: dict[str, tuple[float, float]],
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from edgellm.quant.qparams import FP8_MAX

    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for f in safetensors_files(src):
        with safe_open(str(f), framework="pt") as h:
            names = list(h.keys())
            for name in tqdm(names, desc="save", leave=False):
                module, _, param = name.rpartition(".")
                if module in results:
                    if param == "weight" and module not in done:
                        for k, t in linear_tensors(results[module], fmt, scheme, dtype).items():
                            out[f"{module}.{k}"] = t.contiguous()
                        done.add(module)
                        continue
                    if param != "bias":
                        raise ConvertError(
                            f"{src}: unexpected tensor {name!r} on a quantized linear"
                        )
                t = state[name] if name in state else h.get_tensor(name)
                out[name] = (t.to(dtype) if t.is_floating_point() else t).detach().contiguous()
    missing = set(results) - done
    if missing:
        raise ConvertError(
            f"{src}: the checkpoint does not store {sorted(missing)[0]}.weight under that name"
        )
    for attn, (k_max, v_max) in kv.items():
        out[f"{attn}.k_scale"] = round_scale(torch.tensor([max(k_max, 1e-6) / FP8_MAX]), dtype).to(
            dtype
        )
        out[f"{attn}.v_scale"] = round_scale(torch.tensor([max(v_max, 1e-6) / FP8_MAX]), dtype).to(
            dtype
        )
    return out


def write_checkpoint(
    tmp: Path,
    src: Path,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    qc: dict[str, Any],
    dtype: torch.dtype,
    fmt: str,
) -> None:
    from safetensors.torch import save_file

    config = dict(config)
    config["quantization_config"] = qc
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if fmt == "gptq":
        (tmp / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    copy_side_files(src, tmp)


def install(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished temp dir to OUT; an existing OUT (or a symlink named OUT) goes only with
    --force."""
    if out.is_symlink() or out.exists():
        if not force:
            raise ConvertError(f"{out} exists; pass --force to replace it")
        if out.is_symlink() or out.is_file():
            out.unlink()  # the link itself, never what it points to
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(tmp, out)
