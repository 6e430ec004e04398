"""The `edgellm convert` command line: its arguments, the run (SIGTERM and Ctrl-C leave nothing
behind: exit 130), the printed report. `python -m edgellm.quant.convert_cli` runs it alone.
The work is edgellm/quant/convert.py's, and its docstring is the command's help."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from edgellm.quant import calibration as calib
from edgellm.quant import convert as _convert
from edgellm.quant.convert import REPORT_NAME, convert
from edgellm.quant.convert_options import (
    DEFAULT_NUM_SAMPLES,
    DEFAULT_SEQ_LEN,
    SCHEMES,
    ConvertOptions,
)
from edgellm.quant.convert_source import ConvertError


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['scheme']} ({r['algorithm']}, {r['format']}) -> {r['output']}"]
    size = r["size_bytes"]
    lines.append(
        f"  size: {size['source'] / 2**20:.1f} MiB -> {size['quantized'] / 2**20:.1f} MiB "
        f"({size['ratio']:.2f}x)"
    )
    if "perplexity_source" in r:
        lines.append(
            f"  perplexity (held-out, {r['eval_tokens']} tokens, {r['eval_path']}): "
            f"{r['perplexity_source']:.3f} -> {r['perplexity_quantized']:.3f} "
            f"({100 * r['perplexity_relative_change']:+.2f}%)"
        )
        lines.append(
            f"  logits: relative error {r['logit_relative_error']:.4f}, "
            f"KL {r['mean_kl_divergence']:.5f}, top-1 agreement {100 * r['top1_agreement']:.1f}%"
        )
    lines.append(
        f"  time: quantize {r['quantize_seconds']:.1f} s, total {r['total_seconds']:.1f} s"
    )
    return "\n".join(lines)


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="quantize an HF checkpoint (GPTQ, AWQ, SmoothQuant, FP8) with a quality report",
        description=_convert.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(p)
    p.set_defaults(func=cmd_convert)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="HF safetensors directory, a .gguf file, or 'default'")
    p.add_argument("out", help="output directory (refused if it exists, unless --force)")
    p.add_argument("--scheme", required=True, help=", ".join([*SCHEMES, "rtn"]))
    p.add_argument(
        "--calib", default=None, help="calibration text file (default: the shipped corpus)"
    )
    p.add_argument("--num-samples", type=int, default=DEFAULT_NUM_SAMPLES)
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument(
        "--group-size", type=int, default=None, help="int weights: 128 by default; -1: per channel"
    )
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_const", const=True, default=None)
    sym.add_argument("--asym", dest="symmetric", action="store_const", const=False)
    p.add_argument(
        "--actorder",
        default="default",
        choices=["default", "none", "static", "group"],
        help="GPTQ column order (default: static, as llm-compressor)",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=None,
        help="module name or 're:REGEX' to leave unquantized (repeatable; lm_head always)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument(
        "--format", default="compressed-tensors", choices=["compressed-tensors", "awq", "gptq"]
    )
    p.add_argument(
        "--dtype", default="auto", help="scales and unquantized tensors: auto | float16 | bfloat16"
    )
    p.add_argument(
        "--damp", type=float, default=0.01, help="GPTQ dampening (fraction of mean diag H)"
    )
    p.add_argument("--smoothing-strength", type=float, default=0.8, help="SmoothQuant alpha")
    p.add_argument(
        "--no-eval", dest="evaluate", action="store_false", help="skip the perplexity report"
    )
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def cmd_convert(args: argparse.Namespace) -> int:
    ignore = ["lm_head", *(args.ignore or [])]
    opts = ConvertOptions(
        src=args.src,
        out=args.out,
        scheme=args.scheme,
        calib=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        group_size=args.group_size,
        symmetric=args.symmetric,
        actorder=None if args.actorder == "none" else args.actorder,
        ignore=tuple(dict.fromkeys(ignore)),
        kv_cache_dtype=args.kv_cache_dtype,
        format=args.format,
        force=args.force,
        dtype=args.dtype,
        damp=args.damp,
        smoothing_strength=args.smoothing_strength,
        evaluate=args.evaluate,
        eval_samples=args.eval_samples,
    )
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        report = convert(opts)
    except (ConvertError, calib.CalibrationError) as exc:
        print(f"edgellm convert: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("edgellm convert: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(format_report(report))
    print(f"  report: {Path(report['output']) / REPORT_NAME}")
    return 0


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through convert(), which removes its temp dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="edgellm convert",
        description=_convert.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return cmd_convert(args)
    except (ValueError, OSError) as exc:
        print(f"edgellm convert: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
