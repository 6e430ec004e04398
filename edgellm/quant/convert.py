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

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgellm.quant import calibration as calib
from edgellm.quant.convert_options import (
    ConvertOptions,
    check_shapes,
    matches_ignore,
    out_dtype,
    resolve_scheme,
)
from edgellm.quant.convert_source import (
    CONVERT_ARCHS,
    ConvertError,
    check_source_config,
    gguf_to_hf,
    resolve_source,
)
from edgellm.quant.convert_write import build_state_dict, install, write_checkpoint
from edgellm.quant.decoder_parts import decoder_layers, layer_parts
from edgellm.quant.export_config import (
    awq_quantization_config,
    ct_quantization_config,
    gptq_quantization_config,
)
from edgellm.quant.quality import compare, open_quantized, weights_size
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

REPORT_NAME = "quantization_report.json"


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
    dtype = out_dtype(opts, config)
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
    prefix, layers = decoder_layers(model)
    linears: dict[str, nn.Linear] = {}
    for i, layer in enumerate(layers):
        linears.update(layer_parts(layer, f"{prefix}.{i}").linears)
    skip = {n for n in linears if matches_ignore(n, list(opts.ignore))}
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
        install(tmp, out, opts.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _open_src_llm(src: Path, max_len: int) -> Any:
    from edgellm.quant.quality import _open_llm

    return _open_llm(src, max_len)
