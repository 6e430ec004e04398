"""Calibration data and the layer-by-layer reference forward.

Text: the user's file, or the English corpus shipped in edgellm/data. It is
tokenized with the source's tokenizer (bytes when the source has none, e.g. a
bare test checkpoint) and split: the head feeds calibration windows, the
tail (never seen by calibration) is the held-out text of the quality report.

The forward is transformers' own model, run one decoder layer at a time
(as GPTQ does): the inputs of layer 0 are captured once, each layer is
calibrated and quantized, then the *quantized* layer's outputs become the
next layer's inputs. Memory stays at one layer's activations for the
calibration set, whatever the depth.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

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


# -- the decoder's parts, by role ------------------------------------------------------


@dataclass
class LayerParts:
    """One decoder layer's modules by role (fused = Phi-3 style qkv_proj / gate_up_proj).

    attn_norm / mlp_norm: the norm whose output the q/k/v (gate/up) linears read, where there is
    one: Llama-style layers have both, Gemma 3 has them too (its MLP reads
    pre_feedforward_layernorm), EXAONE 4's post-norm layers have neither (the linears read the
    residual stream itself, so no input scale can be folded anywhere). norm_offset: the norms
    scale by (offset + weight) (1 for Gemma's)."""

    layer: nn.Module
    prefix: str  # e.g. "model.layers.3"
    attn: nn.Module
    mlp: nn.Module
    attn_norm: nn.Module | None
    mlp_norm: nn.Module | None
    qkv: dict[str, nn.Linear]  # {"q_proj":..., "k_proj":..., "v_proj":...} or {"qkv_proj": ...}
    o: tuple[str, nn.Linear]
    gate_up: dict[str, nn.Linear]  # {"gate_proj":..., "up_proj":...} or {"gate_up_proj": ...}
    down: tuple[str, nn.Linear]
    linears: dict[str, nn.Linear] = field(default_factory=dict)  # full name -> module
    norm_offset: float = 0.0

    def divide_norm(self, norm: nn.Module, s: torch.Tensor) -> None:
        """Divide `norm`'s output per channel by s (the linears reading it take s on their
        inputs): (offset + weight) / s as the new (offset + weight)."""
        w = norm.weight.data
        w.copy_((w.float() + self.norm_offset) / s - self.norm_offset)

    @property
    def fused_qkv(self) -> bool:
        return "qkv_proj" in self.qkv

    @property
    def fused_gate_up(self) -> bool:
        return "gate_up_proj" in self.gate_up


def _norm_offset(model: nn.Module) -> float:
    """What the model's RMSNorms add to their weight (Gemma's (1 + weight)), from its
    architecture."""
    from edgellm.models.arch import resolve_architecture

    try:
        return resolve_architecture(model.config.to_dict()).norm_weight_offset
    except (AttributeError, ValueError):
        return 0.0


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CalibrationError(f"{type(model).__name__}: no model.layers; unsupported architecture")
    return "model.layers", layers


def layer_parts(layer: nn.Module, prefix: str, norm_offset: float = 0.0) -> LayerParts:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        raise CalibrationError(f"{prefix}: not a Llama-style decoder layer")
    attn_norm = getattr(layer, "input_layernorm", None)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: norms around both branches
        mlp_norm = layer.pre_feedforward_layernorm
    elif hasattr(layer, "post_feedforward_layernorm"):  # EXAONE 4: norms on branch outputs only
        mlp_norm = None
    else:
        mlp_norm = getattr(layer, "post_attention_layernorm", None)
        if attn_norm is None or mlp_norm is None:
            raise CalibrationError(f"{prefix}: not a Llama-style decoder layer")
    if hasattr(attn, "qkv_proj"):
        qkv = {"qkv_proj": attn.qkv_proj}
    else:
        qkv = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}
    gate_up = (
        {"gate_up_proj": mlp.gate_up_proj}
        if hasattr(mlp, "gate_up_proj")
        else {n: getattr(mlp, n) for n in ("gate_proj", "up_proj")}
    )
    parts = LayerParts(
        layer,
        prefix,
        attn,
        mlp,
        attn_norm,
        mlp_norm,
        qkv,
        ("o_proj", attn.o_proj),
        gate_up,
        ("down_proj", mlp.down_proj),
        norm_offset=norm_offset,
    )
    for name, mod in qkv.items():
        parts.linears[f"{prefix}.self_attn.{name}"] = mod
    parts.linears[f"{prefix}.self_attn.o_proj"] = attn.o_proj
    for name, mod in gate_up.items():
        parts.linears[f"{prefix}.mlp.{name}"] = mod
    parts.linears[f"{prefix}.mlp.down_proj"] = mlp.down_proj
    for name, mod in parts.linears.items():
        if not isinstance(mod, nn.Linear):
            raise CalibrationError(f"{name}: expected a Linear, got {type(mod).__name__}")
    return parts


# -- hooks -------------------------------------------------------------------------------


@contextmanager
def input_hooks(
    modules: dict[str, nn.Module], fn: Callable[[str, torch.Tensor], None]
) -> Iterator[None]:
    """Call fn(name, input) for the first positional input of each module while active."""
    handles = [
        m.register_forward_pre_hook(lambda mod, args, _n=name: fn(_n, args[0].detach()))
        for name, m in modules.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _StopForward(Exception):
    pass


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class LayerwiseRunner:
    """Replays the calibration set through one decoder layer at a time.

    Each layer's keyword arguments (attention mask, rotary tables, ...) are recorded as that layer
    received them, from one run of the float model per batch shape (they depend on the shape, not
    on the tokens: no padding mask is passed); layers of different kinds (Gemma 3's and EXAONE
    4's sliding-window and global layers) take different ones. Other batches of a shape already
    seen stop at the first layer, whose input is all they add."""

    def __init__(self, model: nn.Module, samples: list[list[int]], batch_size: int = 8) -> None:
        self.model = model
        self.prefix, self.layers = decoder_layers(model)
        self.norm_offset = _norm_offset(model)
        self.hidden: list[torch.Tensor] = []
        self.kwargs: list[list[dict[str, Any]]] = []  # [batch][layer]
        last = len(self.layers) - 1
        captured: dict[str, Any] = {}

        def catch(index: int) -> Callable:
            def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                kwargs = dict(kwargs)
                hidden = args[0] if args else kwargs.pop("hidden_states")
                if index == 0:
                    captured["hidden"] = hidden
                    if captured["known"]:
                        raise _StopForward
                captured["kwargs"].append(kwargs)
                if index == last:
                    raise _StopForward

            return hook

        handles = [
            layer.register_forward_pre_hook(catch(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        try:
            batches = [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
            by_shape: dict[tuple[int, ...], list[dict[str, Any]]] = {}
            for batch in tqdm(batches, desc="calibration: embed", leave=False):
                ids = torch.tensor(batch, dtype=torch.long)
                shape = tuple(ids.shape)
                captured["kwargs"], captured["known"] = [], shape in by_shape
                try:
                    with torch.no_grad():
                        model(input_ids=ids, use_cache=False)
                except _StopForward:
                    pass
                self.hidden.append(captured["hidden"].detach())
                self.kwargs.append(by_shape.setdefault(shape, captured["kwargs"]))
        finally:
            for h in handles:
                h.remove()

    def parts(self, index: int) -> LayerParts:
        return layer_parts(self.layers[index], f"{self.prefix}.{index}", self.norm_offset)

    @torch.no_grad()
    def forward(self, index: int, advance: bool = False) -> None:
        """Run every batch through layer `index` (hooks see its inputs); advance: keep outputs."""
        layer = self.layers[index]
        for b, (h, kw) in enumerate(zip(self.hidden, self.kwargs)):
            out = _layer_output(layer(h, **kw[index]))
            if advance:
                self.hidden[b] = out.detach()

    @torch.no_grad()
    def run_module(
        self, module: nn.Module, inputs: list[torch.Tensor], index: int | None = None
    ) -> list[torch.Tensor]:
        """Run a sub-module of a layer: self_attn of layer `index` with that layer's kwargs, or
        (index None) an MLP or a linear."""
        if index is None:
            return [module(x) for x in inputs]
        return [
            _layer_output(module(hidden_states=x, **kw[index]))
            for x, kw in zip(inputs, self.kwargs)
        ]
