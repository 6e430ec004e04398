"""`edgellm convert SRC OUT --scheme SCHEME`: calibrate -> quantize -> save -> report.

SRC is an HF safetensors directory, a .gguf file, or `default` (the embedded
SmolLM2-135M-Instruct GGUF, dequantized to an fp16 HF directory first). OUT
is written atomically (a temp dir in OUT's parent, renamed at the end) and
holds config.json (quantization_config as the community tool writes it),
model.safetensors, the source's tokenizer files and quantization_report.json.

    scheme        weights                 activations      algorithm         on disk
    w4a16-gptq    int4 g128 sym, act-order -               GPTQ              CT pack-quantized
    w4a16-awq     int4 g128 asym           -               AWQ               CT pack-quantized
    w4a16-rtn     int4 g128 sym            -               round-to-nearest  CT pack-quantized
    w8a8-int8     int8 per channel         int8 per token  SmoothQuant+GPTQ  CT int-quantized
    w8a16-int8    int8 per channel         -               GPTQ              CT pack-quantized
    fp8-dynamic   fp8 per channel          fp8 per token   min-max           CT float-quantized
    fp8-static    fp8 per tensor           fp8 per tensor  min-max + calib.  CT float-quantized

CT = compressed-tensors (llm-compressor's format). `--format awq` / `--format gptq`
write int4 schemes in the AutoAWQ "gemm" / GPTQ v1 (GPTQModel) layouts instead.
`--kv-cache-dtype fp8` adds per-layer K/V scales (self_attn.k_scale / v_scale) and
quantization_config.kv_cache_scheme. `rtn` is an alias of w4a16-rtn.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from edgellm.quant import calibration as calib
from edgellm.quant.convert_source import (
    CONVERT_ARCHS,
    ConvertError,
    check_source_config,
    gguf_to_hf,
    resolve_source,
    safetensors_files,
)
from edgellm.quant.export import (
    Scheme,
    awq_quantization_config,
    ct_quantization_config,
    gptq_quantization_config,
    linear_tensors,
)
from edgellm.quant.qparams import FP8Weight, IntWeight, round_scale
from edgellm.quant.quality import compare, copy_side_files, open_quantized, weights_size
from edgellm.quant.quantize_pass import quantize_model

__all__ = [
    "ConvertError",
    "ConvertOptions",
    "convert",
    "gguf_to_hf",
    "resolve_source",
    "CONVERT_ARCHS",
]

logger = logging.getLogger("edgellm.convert")

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w4a16-gptq", "int", "gptq", 4, True, 128, actorder="static"),
        Scheme("w4a16-awq", "int", "awq", 4, False, 128),
        Scheme("w4a16-rtn", "int", "rtn", 4, True, 128),
        Scheme(
            "w8a8-int8", "int", "smoothquant+gptq", 8, True, -1, "int8-token", actorder="static"
        ),
        Scheme("w8a16-int8", "int", "gptq", 8, True, -1, actorder="static"),
        Scheme("fp8-dynamic", "fp8", "minmax", 8, True, -1, "fp8-token", fp8_per_channel=True),
        Scheme("fp8-static", "fp8", "minmax", 8, True, -1, "fp8-static", fp8_per_channel=False),
    )
}
SCHEME_ALIASES = {"rtn": "w4a16-rtn"}
REPORT_NAME = "quantization_report.json"
DEFAULT_NUM_SAMPLES = 64
DEFAULT_SEQ_LEN = 256


@dataclasses.dataclass
class ConvertOptions:
    src: str
    out: str
    scheme: str
    calib: str | None = None
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    group_size: int | None = None
    symmetric: bool | None = None
    actorder: str | None = "default"  # "default" | None | "static" | "group"
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache_dtype: str = "auto"
    format: str = "compressed-tensors"
    force: bool = False
    dtype: str = "auto"
    damp: float = 0.01
    smoothing_strength: float = 0.8
    awq_grid: int = 20
    awq_duo_scaling: bool = False
    evaluate: bool = True
    eval_samples: int = 16
    batch_size: int = 8
    seed: int = 0


# -- options --------------------------------------------------------------------------


def resolve_scheme(opts: ConvertOptions) -> Scheme:
    name = SCHEME_ALIASES.get(opts.scheme, opts.scheme)
    if name not in SCHEMES:
        raise ConvertError(
            f"unsupported scheme {opts.scheme!r}; choose one of {', '.join(SCHEMES)}, rtn"
        )
    s = SCHEMES[name]
    changes: dict[str, Any] = {}
    if opts.group_size is not None:
        if s.kind == "fp8" or s.activations == "int8-token":
            raise ConvertError(f"--group-size does not apply to {name} (per-channel/tensor scales)")
        if opts.group_size == 0 or opts.group_size < -1:
            raise ConvertError(
                "--group-size must be positive, or -1 for one scale per output channel"
            )
        changes["group_size"] = opts.group_size
    if opts.symmetric is not None:
        if s.kind == "fp8" or s.activations:
            raise ConvertError(f"--sym/--asym does not apply to {name}")
        changes["symmetric"] = opts.symmetric
    if opts.actorder != "default":
        if s.algorithm not in ("gptq", "smoothquant+gptq"):
            raise ConvertError("--actorder only applies to GPTQ schemes")
        changes["actorder"] = opts.actorder
    s = dataclasses.replace(s, **changes)
    if opts.format not in ("compressed-tensors", "awq", "gptq"):
        raise ConvertError(f"unknown --format {opts.format!r} (compressed-tensors, awq, gptq)")
    if opts.format != "compressed-tensors":
        if s.kind != "int" or s.bits != 4:
            raise ConvertError(
                f"--format {opts.format} holds int4 weights only; {name} is not int4"
            )
        if opts.kv_cache_dtype == "fp8":
            raise ConvertError(
                f"--kv-cache-dtype fp8 needs the compressed-tensors format, not {opts.format}"
            )
        if opts.format == "awq":
            if s.symmetric and opts.symmetric is not None:
                raise ConvertError("--format awq is always asymmetric (zero_point); drop --sym")
            if s.actorder == "group":
                raise ConvertError("--format awq cannot hold act-order (g_idx)")
            s = dataclasses.replace(s, symmetric=False)
        if s.group_size <= 0:
            raise ConvertError(f"--format {opts.format} needs a positive --group-size")
    if opts.format == "compressed-tensors" and s.actorder == "group":
        raise ConvertError(
            "--actorder group (g_idx) is not loadable as compressed-tensors (removed in 0.20); "
            "use --actorder static, or --format gptq (desc_act)"
        )
    if opts.kv_cache_dtype not in ("auto", "fp8"):
        raise ConvertError("--kv-cache-dtype must be auto or fp8")
    if opts.num_samples < 1 or opts.seq_len < 8:
        raise ConvertError("--num-samples must be >= 1 and --seq-len >= 8")
    return s


def _out_dtype(opts: ConvertOptions, config: dict[str, Any]) -> torch.dtype:
    if opts.format != "compressed-tensors":
        return torch.float16  # AutoAWQ / GPTQ kernels read fp16 scales
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    if opts.dtype != "auto":
        if opts.dtype not in table:
            raise ConvertError("--dtype must be auto, float16 or bfloat16")
        return table[opts.dtype]
    src = str(config.get("dtype") or config.get("torch_dtype") or "float16")
    return table.get(src, torch.float16)


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p) or name.rsplit(".", 1)[-1] == p:
            return True
    return False


def check_shapes(linears: dict[str, nn.Linear], scheme: Scheme, fmt: str) -> None:
    """Every dimension constraint, checked before any work, one line each."""
    for name, lin in linears.items():
        n, k = lin.out_features, lin.in_features
        if scheme.kind == "int" and scheme.group_size > 0 and k % scheme.group_size:
            divisors = [g for g in (256, 128, 64, 32, 16) if k % g == 0]
            raise ConvertError(
                f"group size {scheme.group_size} does not divide the input dim {k} of {name}"
                + (f" (try --group-size {divisors[0]})" if divisors else "")
            )
        if scheme.kind == "int" and scheme.bits == 4 and k % 8:
            raise ConvertError(f"{name}: input dim {k} is not a multiple of 8 (int4 packing)")
        if scheme.kind == "int" and scheme.bits == 8 and not scheme.activations and k % 4:
            raise ConvertError(f"{name}: input dim {k} is not a multiple of 4 (int8 packing)")
        if (fmt in ("awq", "gptq") or not scheme.symmetric) and n % 8:
            raise ConvertError(
                f"{name}: output dim {n} is not a multiple of 8 (packed zero points)"
            )


# -- writing ---------------------------------------------------------------------------


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


def _install(tmp: Path, out: Path, force: bool) -> None:
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


def convert(opts: ConvertOptions) -> dict[str, Any]:
    """Run one conversion; returns the report. Raises ConvertError on bad input."""
    t0 = time.time()
    scheme = resolve_scheme(opts)
    out = Path(opts.out).expanduser()
    out = (
        out.parent.resolve() / out.name
    )  # resolve the parent only: a symlink named OUT is never followed
    if (out.exists() or out.is_symlink()) and not opts.force:
        raise ConvertError(f"{out} exists; pass --force to replace it")
    src, src_desc = resolve_source(opts.src)
    config = check_source_config(src)
    dtype = _out_dtype(opts, config)
    extra_ignore = [p for p in opts.ignore if p != "lm_head"]
    if extra_ignore and opts.format == "gptq":
        raise ConvertError("--ignore beyond lm_head is not supported with --format gptq")

    from transformers import AutoModelForCausalLM

    logger.info("loading %s", src_desc)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src), dtype=torch.float32, attn_implementation="sdpa"
        )
    except Exception as exc:
        raise ConvertError(
            f"{src}: transformers cannot load it ({str(exc).splitlines()[0][:200]})"
        ) from None
    model.eval()
    prefix, layers = calib.decoder_layers(model)
    linears: dict[str, nn.Linear] = {}
    for i, layer in enumerate(layers):
        linears.update(calib.layer_parts(layer, f"{prefix}.{i}").linears)
    skip = {n for n in linears if _matches(n, list(opts.ignore))}
    check_shapes({n: m for n, m in linears.items() if n not in skip}, scheme, opts.format)

    vocab = int(config.get("vocab_size") or model.config.vocab_size)
    tokenizer = calib.load_tokenizer(src, vocab)
    text = calib.read_text(opts.calib)
    ids = calib.encode(tokenizer, text)
    bos = getattr(tokenizer, "bos_token_id", None)
    cset = calib.build_calibration_set(
        ids,
        opts.num_samples,
        opts.seq_len,
        opts.eval_samples,
        bos_id=bos,
        seed=opts.seed,
        source=opts.calib or "the shipped corpus",
    )
    needs_samples = scheme.needs_calibration or opts.kv_cache_dtype == "fp8"
    t_quant = time.time()
    with torch.no_grad():
        results, kv = quantize_model(
            model, scheme, opts, cset.samples if needs_samples else None, dtype, skip
        )
    quant_seconds = time.time() - t_quant

    if opts.format == "awq":
        qc = awq_quantization_config(scheme, extra_ignore)
    elif opts.format == "gptq":
        qc = gptq_quantization_config(scheme, opts.damp)
    else:
        ignore = sorted({n for n in skip} | ({"lm_head"} if "lm_head" in opts.ignore else set()))
        qc = ct_quantization_config(scheme, ignore, opts.kv_cache_dtype == "fp8")
    state = build_state_dict(model, src, results, scheme, opts.format, dtype, kv)
    del model

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.eval-", dir=out.parent))
    try:
        write_checkpoint(tmp, src, config, state, qc, dtype, opts.format)
        del state
        report: dict[str, Any] = {
            "source": src_desc,
            "output": str(out),
            "scheme": scheme.name,
            "algorithm": scheme.algorithm,
            "format": opts.format,
            "quant_method": qc.get("quant_method"),
            "weights": {
                "bits": scheme.bits,
                "symmetric": scheme.symmetric,
                "group_size": scheme.group_size,
                "actorder": scheme.actorder,
            },
            "kv_cache_dtype": opts.kv_cache_dtype,
            "calibration": {
                "text": opts.calib or "edgellm/data/calibration.txt",
                "tokens": cset.total_tokens,
                "num_samples": len(cset.samples) if needs_samples else 0,
                "seq_len": opts.seq_len,
            },
            "size_bytes": {"source": weights_size(src), "quantized": weights_size(tmp)},
            "quantize_seconds": round(quant_seconds, 2),
        }
        report["size_bytes"]["ratio"] = (
            report["size_bytes"]["quantized"] / report["size_bytes"]["source"]
        )
        if opts.evaluate and cset.held_out:
            max_len = max(len(w) for w in cset.held_out) + 8
            src_llm = _open_src_llm(src, max_len)
            q_llm, path = open_quantized(tmp, work, max_len)
            report["eval_path"] = path
            if path == "dequantized":
                report["eval_note"] = (
                    "edgellm's engine cannot load this format yet: the checkpoint was read back "
                    "from disk "
                    "to float32 and that was evaluated (weight quantization exact; activation and "
                    "KV-cache "
                    "quantization not simulated)"
                )
            report.update(compare(src_llm, q_llm, cset.held_out))
            del src_llm, q_llm
        report["total_seconds"] = round(time.time() - t0, 2)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        _install(tmp, out, opts.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _open_src_llm(src: Path, max_len: int) -> Any:
    from edgellm.quant.quality import _open_llm

    return _open_llm(src, max_len)
