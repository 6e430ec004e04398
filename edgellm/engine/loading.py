"""What an engine loads before it sizes its cache: the checkpoint, its config, the tokenizer, the
end-of-generation ids and the model (on the config's device, with the CPU kernels the Platform
chooses). Whatever a bad checkpoint makes the loader raise comes out as a CheckpointError that
names the file."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from edgellm.config import EngineConfig, ModelConfig, kv_cache_torch_dtype
from edgellm.loader import CheckpointError, load_model, model_config, resolve_checkpoint
from edgellm.platform import Platform
from edgellm.quant.linear_kernels.cpu_int import int_dot_kernels
from edgellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Loaded:
    checkpoint: Any  # loader.Checkpoint
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]  # the model's, then the tokenizer's
    model: Any  # models.decoder.CausalLM
    kv_dtype: torch.dtype
    requested_len: int  # max_model_len asked for, else the model's own limit


@contextlib.contextmanager
def names_the_file(source: object) -> Iterator[None]:
    """Whatever a bad checkpoint makes the loader raise becomes a CheckpointError (a ValueError: the
    CLI prints it as one line, no traceback) that names the file and the problem."""
    try:
        yield
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:
        if isinstance(exc, CheckpointError):
            raise  # the loader's own errors name their file already
        where, msg = str(source), str(exc) or type(exc).__name__
        if not isinstance(exc, ValueError):
            msg = f"cannot load ({type(exc).__name__}: {msg})"
        raise CheckpointError(msg if where in msg else f"{where}: {msg}") from exc


def load(config: EngineConfig, device: torch.device) -> Loaded:
    with names_the_file(config.model or "the embedded default model"):
        checkpoint = resolve_checkpoint(config.model)
    with names_the_file(checkpoint.path):
        mcfg = model_config(checkpoint, config.architecture)
        tokenizer = Tokenizer.load(
            checkpoint.path,
            checkpoint.kind,
            config.chat_template,
            fallback_template=checkpoint.fallback_chat_template,
        )
    eos = list(mcfg.eos_token_ids)
    if tokenizer is not None:
        eos += [t for t in tokenizer.eos_token_ids if t not in eos]
    platform = Platform.create(config.cpu_quant, config.cpu_isa)
    requested_len = config.max_model_len or mcfg.max_position_embeddings
    if config.max_model_len and config.max_model_len > mcfg.max_position_embeddings:
        logger.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d",
            config.max_model_len,
            mcfg.max_position_embeddings,
        )
    with names_the_file(checkpoint.path):
        model = load_model(
            checkpoint,
            config.torch_dtype,
            device,
            max_position=requested_len,
            architecture=config.architecture,
            cpu_kernels=platform,
        )
    # mode auto's fp16 pages only where its integer dots already round the activations
    kv_dtype = kv_cache_torch_dtype(
        config.kv_cache_dtype, config.torch_dtype, device, bool(int_dot_kernels(model))
    )
    return Loaded(checkpoint, mcfg, tokenizer, eos, model, kv_dtype, requested_len)
