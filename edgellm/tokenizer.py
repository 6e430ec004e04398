"""The model's own tokenizer and chat template (transformers), and incremental
detokenization that never emits a broken UTF-8 character.

A GGUF's tokenizer is converted by transformers from the file's metadata; the
conversion is slow (seconds), so the result is cached on disk keyed by the
file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgellm import env

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    pass


def _load_hf(path: Path, gguf_file: str | None = None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except ValueError as exc:
        if not gguf_file or "is not supported yet" not in str(exc):
            raise
    # A GGUF architecture transformers cannot build a config for (EXAONE 4): the tokenizer alone,
    # from the file's tokenizer.ggml.* keys, needs no config.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)


def _gguf_tokenizer(gguf_path: Path) -> Any:
    st = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    cached = env.cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").is_file():
        try:
            return _load_hf(cached)
        except Exception as exc:  # a damaged cache entry is rebuilt
            logger.warning("ignoring cached tokenizer %s: %s", cached, exc)
    tok = _load_hf(gguf_path.parent, gguf_path.name)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError as exc:
        logger.info("could not cache the GGUF tokenizer: %s", exc)
    return tok


def _is_file(value: str) -> bool:
    """A chat template argument is a path or the template itself (which may be too long for a
    path)."""
    if "\n" in value or "{" in value:
        return False
    try:
        return Path(value).is_file()
    except OSError:
        return False


class Tokenizer:
    """encode / decode / chat template over a transformers tokenizer."""

    def __init__(self, hf: Any, chat_template: str | None = None) -> None:
        self.hf = hf
        if chat_template:
            self.hf.chat_template = chat_template
        self.vocab_size = len(hf)

    @classmethod
    def load(
        cls,
        source: Path,
        kind: str,
        chat_template: str | None = None,
        fallback_template: str | None = None,
    ) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when the directory carries none (token-id prompts
        only).
        `chat_template` overrides the model's; `fallback_template` is used only where it has
        none."""
        if chat_template and _is_file(chat_template):
            chat_template = Path(chat_template).read_text()
        if kind == "gguf":
            hf = _gguf_tokenizer(source)
            if not chat_template and not hf.chat_template and fallback_template:
                logger.info("%s carries no chat template; using its architecture's own", source)
                chat_template = fallback_template
            return cls(hf, chat_template)
        has_files = any(
            (source / f).is_file()
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )
        if not has_files:
            logger.info("%s has no tokenizer; prompts must be token ids", source)
            return None
        try:
            return cls(_load_hf(source), chat_template)
        except Exception as exc:
            raise TokenizerError(f"{source}: cannot load the tokenizer ({exc})") from None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf.eos_token_id
        return [] if eos is None else [int(eos)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.hf.chat_template:
            raise TokenizerError("this model has no chat template; use a plain prompt or give one")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The template writes the special tokens itself (BOS included where the model wants it).
        return self.encode(
            self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )

    def detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of ids ending at the newest token, and emits only
    the part past what the window's prefix already produced. Text ending in
    U+FFFD is held back: the token completed part of a multi-byte character
    (Korean in byte-level BPE takes 2-3 tokens per syllable), and the next
    tokens will finish it. A few prompt tokens seed the window so that
    leading-space rules (sentencepiece) see the right context.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # keep the window small
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (possibly a replacement char)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
