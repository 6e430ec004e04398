"""Tiny quantized checkpoints written the way the community tools write them.

Each linear of a tiny random transformers model (tests/helpers/tiny_models.py) is
quantized round-to-nearest, packed with the exact packers of
edgellm/kernels/int4_layouts.py, and saved with the tool's quantization_config. The
function also returns the transformers model holding the DEQUANTIZED weights:
what a correct loader must reproduce (up to fp32 rounding).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edgellm.kernels.int4_layouts import pack_awq, pack_ct_int4, pack_gptq, pack_int4

LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)


def rtn_int4(
    w: torch.Tensor,
    group_size: int,
    sym: bool,
    g_idx: torch.Tensor | None = None,
    min_zero: int = 0,
):
    """w [N, K] -> (codes [N, K], zeros [N, G] or None, fp16 scales [N, G], W dequantized)."""
    k = w.shape[1]
    g = g_idx.long() if g_idx is not None else torch.arange(k) // group_size
    groups = int(g.max()) + 1
    onehot = torch.nn.functional.one_hot(g, groups).bool()  # [K, G]
    big = torch.finfo(torch.float32).max
    wmax = torch.where(onehot[None], w[:, :, None], -big).amax(1)  # [N, G]
    wmin = torch.where(onehot[None], w[:, :, None], big).amin(1)
    if sym:
        scales = (torch.maximum(wmax.abs(), wmin.abs()) / 7).clamp_min(1e-4).half().float()
        zeros = torch.full_like(scales, 8)
    else:
        scales = ((wmax - wmin) / 15).clamp_min(1e-4).half().float()
        zeros = torch.round(-wmin / scales).clamp(min_zero, 15)
    q = torch.clamp(torch.round(w / scales[:, g]) + zeros[:, g], 0, 15)
    deq = (q - zeros[:, g]) * scales[:, g]
    return q.int(), (None if sym else zeros.int()), scales.half(), deq


def _split_fused(tensors: dict[str, torch.Tensor], q: int, kv: int, inter: int) -> None:
    """Phi-3 on disk with qkv_proj / gate_up_proj split into their shards (in place)."""
    for name in [n for n in tensors if ".qkv_proj." in n]:
        w = tensors.pop(name)
        for shard, part in zip(("q_proj", "k_proj", "v_proj"), w.split((q, kv, kv))):
            tensors[name.replace("qkv_proj", shard)] = part.clone()
    for name in [n for n in tensors if ".gate_up_proj." in n]:
        w = tensors.pop(name)
        for shard, part in zip(("gate_proj", "up_proj"), w.split(inter)):
            tensors[name.replace("gate_up_proj", shard)] = part.clone()


def quantize_checkpoint(
    src: Path,
    hf_model: torch.nn.Module,
    dst: Path,
    fmt: str,
    *,
    group_size: int = 32,
    sym: bool = True,
    desc_act: bool = False,
    split: bool = False,
    ignore: tuple[str, ...] = (),
    shard_g_idx: bool = False,
    seed: int = 0,
) -> tuple[Path, torch.nn.Module]:
    """Write `src` (a tiny HF checkpoint) quantized as `fmt` to `dst`.

    fmt: awq | gptq | gptq_v2 | ct_int4. split: store Phi-3's fused modules as shards.
    desc_act: shuffled g_idx (GPTQ / compressed-tensors actorder group); shard_g_idx: a
    different g_idx for every linear. ignore: module leaf names left unquantized.
    Returns (dst, transformers model with the dequantized weights).
    """
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    if split:
        q = cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
        kv = cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
        _split_fused(tensors, q, kv, cfg["intermediate_size"])
    gen = torch.Generator().manual_seed(seed)
    dequantized: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    shared_perm: dict[int, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if param != "weight" or leaf not in LINEARS or leaf in ignore:
            out[name] = t
            continue
        w = t.float()
        n, k = w.shape
        g_idx = None
        if desc_act:
            if shard_g_idx or k not in shared_perm:
                shared_perm[k] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[shared_perm[k]] = (torch.arange(k) // group_size).int()
        asym = not sym
        codes, zeros, scales, deq = rtn_int4(
            w, group_size, sym=not asym, g_idx=g_idx, min_zero=1 if fmt == "gptq" and asym else 0
        )
        dequantized[name] = deq
        if fmt == "awq":
            assert zeros is not None, "AWQ is asymmetric"
            packed = pack_awq(codes, zeros, scales)
        elif fmt in ("gptq", "gptq_v2"):
            packed = pack_gptq(codes, zeros, scales, group_size, g_idx)
            if fmt == "gptq_v2":
                z = zeros if zeros is not None else torch.full_like(scales, 8, dtype=torch.int32)
                packed["qzeros"] = pack_int4(z.t().int(), 1)
            packed["bias"] = torch.zeros(n, dtype=torch.float16)  # some GPTQ writers add one
            if f"{module}.bias" in tensors:
                del packed["bias"]
        elif fmt == "ct_int4":
            packed = pack_ct_int4(codes, scales, zeros)
            if g_idx is not None:
                packed["weight_g_idx"] = g_idx
        else:
            raise ValueError(fmt)
        for key, value in packed.items():
            out[f"{module}.{key}"] = value
    save_file(out, dst / "model.safetensors")
    cfg["quantization_config"] = _config(fmt, group_size, sym, desc_act, ignore)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))

    ref = copy.deepcopy(hf_model)
    state = ref.state_dict()  # shares storage with the parameters
    fused_parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, deq in dequantized.items():
        if name in state:
            state[name].copy_(deq)
            continue
        module, leaf = name.rsplit(".", 2)[
            :2
        ]  # a shard of a fused transformers module (Phi-3 split)
        fused = "qkv_proj" if leaf in ("q_proj", "k_proj", "v_proj") else "gate_up_proj"
        fused_parts.setdefault(f"{module}.{fused}.weight", {})[leaf] = deq
    for target, parts in fused_parts.items():
        order = [s for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if s in parts]
        if state[target].shape[0] == sum(parts[s].shape[0] for s in order):
            state[target].copy_(torch.cat([parts[s] for s in order]))
    return dst, ref


def _config(fmt: str, group_size: int, sym: bool, desc_act: bool, ignore: tuple[str, ...]) -> dict:
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "version": "gemm",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "modules_to_not_convert": list(ignore) or None,
        }
    if fmt in ("gptq", "gptq_v2"):
        cfg = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": fmt,
            "lm_head": False,
        }
        if ignore:  # AutoGPTQ's way of leaving modules out
            cfg["modules_in_block_to_quantize"] = [
                [f"self_attn.{m}" for m in LINEARS[:4] if m not in ignore],
                [f"mlp.{m}" for m in LINEARS[4:7] if m not in ignore],
            ]
        return cfg
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": sym,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": "group" if desc_act else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"] + [f"re:.*{m}$" for m in ignore],
    }


def _act_hook(kind: str, static: float | None):
    """compressed-tensors' activation quantization, per token (static None) or per tensor."""
    qmax, lo = (127.5, -128) if kind == "int8" else (448.0, -448)

    def hook(module, args):
        (x,) = args
        s = x.abs().amax(-1, keepdim=True) / qmax if static is None else torch.tensor(static)
        if kind == "int8":
            return (torch.clamp(torch.round(x / s), lo, 127) * s,)
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)

    return hook


def quantize_w8a8(
    src: Path,
    hf_model: torch.nn.Module,
    dst: Path,
    kind: str,
    *,
    weight_strategy: str = "channel",
    activations: str | None = "token",
    calibration: list[int] | None = None,
) -> tuple[Path, torch.nn.Module]:
    """compressed-tensors int8 (`int-quantized`) or fp8 (`float-quantized`) with per-channel or
    per-tensor weight scales and dynamic per-token, static per-tensor (a different
    input_scale for every linear, so fused shards disagree) or no activation quantization.
    Returns (dst, transformers model with the dequantized weights and fake-quantized inputs)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    ref = copy.deepcopy(hf_model)
    modules = dict(ref.named_modules())
    amax: dict[str, float] = {}
    if activations == "tensor":  # calibrate: each linear's input absmax on a short prompt
        handles = [
            m.register_forward_pre_hook(
                lambda mod, args, name=n: amax.__setitem__(name, float(args[0].abs().max()))
            )
            for n, m in modules.items()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"
        ]
        with torch.no_grad():
            ref(torch.tensor([calibration or list(range(1, 40))]))
        for h in handles:
            h.remove()
    qmax = 127.0 if kind == "int8" else 448.0
    out: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        module, _, param = name.rpartition(".")
        if param != "weight" or module.rpartition(".")[2] not in LINEARS:
            out[name] = t
            continue
        w = t.float()
        if weight_strategy == "channel":
            scale = (w.abs().amax(1, keepdim=True) / qmax).half().float()
        else:
            scale = (w.abs().max() / qmax).half().float().reshape(1)
        if kind == "int8":
            q = torch.clamp(torch.round(w / scale.reshape(-1, 1)), -127, 127).to(torch.int8)
        else:
            q = (w / scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q
        out[f"{module}.weight_scale"] = scale.half()
        modules[module].weight.data.copy_(q.float() * scale.reshape(-1, 1))
        static = None
        if activations == "tensor":
            static = float((torch.tensor(amax[module]) / qmax * (0.8 + 0.1 * (i % 5))).half())
            out[f"{module}.input_scale"] = torch.tensor([static], dtype=torch.float16)
        if activations is not None:
            modules[module].register_forward_pre_hook(_act_hook(kind, static))
    save_file(out, dst / "model.safetensors")
    weights = {
        "num_bits": 8,
        "type": "int" if kind == "int8" else "float",
        "symmetric": True,
        "strategy": weight_strategy,
        "dynamic": False,
        "group_size": None,
    }
    acts = None
    if activations is not None:
        acts = {
            "num_bits": 8,
            "type": weights["type"],
            "symmetric": True,
            "dynamic": activations == "token",
            "strategy": activations,
        }
    fmt = "int-quantized" if kind == "int8" else "float-quantized"
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref
