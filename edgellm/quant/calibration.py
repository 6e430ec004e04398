"""Calibration data: the text, its tokens, and the calibration / held-out windows.

Text: the user's file, or the English corpus shipped in edgellm/data. It is
tokenized with the source's tokenizer (bytes when the source has none, e.g. a
bare test checkpoint) and split: the head feeds calibration windows, the
tail (never seen by calibration) is the held-out text of the quality report.
The layer-by-layer forward that replays the windows is edgellm/quant/layerwise.py.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "edgellm" / "data" / "calibration.txt"
HELD_OUT_FRACTION = 0.25


class CalibrationError(ValueError):
    pass


def default_corpus_path() -> Path:
    """The shipped corpus (edgellm/data/calibration.txt), found through the installed package."""
    import edgellm

    path = Path(edgellm.__file__).resolve().parent / "data" / "calibration.txt"
    return path if path.is_file() else DEFAULT_CORPUS


def read_text(path: str | Path | None) -> str:
    p = Path(path) if path else default_corpus_path()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"cannot read calibration text {p}: {exc}") from None
    if not text.strip():
        raise CalibrationError(f"calibration text {p} is empty")
    return text


class ByteTokenizer:
    """Fallback for checkpoints without a tokenizer: one token per UTF-8 byte (mod vocab)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


def load_tokenizer(src: Path, vocab_size: int) -> Any:
    """The source's HF tokenizer, or ByteTokenizer when it ships none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if any((src / n).is_file() for n in names):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        except Exception as exc:  # an unreadable tokenizer is a bad checkpoint, said in one line
            raise CalibrationError(f"{src}: cannot load the tokenizer ({exc})") from None
    logger.warning(
        "%s has no tokenizer: calibration text is fed as bytes (mod vocab %d)", src, vocab_size
    )
    return ByteTokenizer(vocab_size)


def encode(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class CalibrationSet:
    samples: list[list[int]]  # num_samples windows of seq_len tokens
    held_out: list[list[int]]  # disjoint windows for the quality report
    total_tokens: int


def build_calibration_set(
    token_ids: list[int],
    num_samples: int,
    seq_len: int,
    eval_samples: int = 16,
    eval_len: int | None = None,
    bos_id: int | None = None,
    seed: int = 0,
    source: str = "calibration text",
) -> CalibrationSet:
    """Split tokens into calibration windows (head) and held-out windows (tail)."""
    if num_samples < 1 or seq_len < 2:
        raise CalibrationError("--num-samples must be >= 1 and --seq-len >= 2")
    eval_len = eval_len or min(seq_len, 256)
    n = len(token_ids)
    held = max(int(n * HELD_OUT_FRACTION), min(eval_len, n // 2))
    head, tail = token_ids[: n - held], token_ids[n - held :]
    if len(head) < seq_len or len(tail) < 16:
        need = int((seq_len + 16) / (1 - HELD_OUT_FRACTION)) + 1
        raise CalibrationError(
            f"{source} is too short: {n} tokens, need at least {need} for --seq-len {seq_len} "
            f"(calibration windows plus {HELD_OUT_FRACTION:.0%} held out)"
        )
    prefix = [bos_id] if bos_id is not None else []
    body = seq_len - len(prefix)
    if len(head) >= num_samples * body:
        starts = [i * body for i in range(num_samples)]
    else:  # a short corpus: overlapping windows at seeded random offsets
        rng = random.Random(seed)
        starts = sorted(rng.randrange(0, len(head) - body + 1) for _ in range(num_samples))
        logger.info(
            "calibration: %d tokens < %d x %d; sampling overlapping windows",
            len(head),
            num_samples,
            body,
        )
    samples = [prefix + head[s : s + body] for s in starts]
    ebody = min(eval_len, len(tail) + len(prefix)) - len(prefix)
    held_out = [prefix + tail[i : i + ebody] for i in range(0, len(tail) - ebody + 1, ebody)][
        :eval_samples
    ]
    return CalibrationSet(samples, held_out, n)
