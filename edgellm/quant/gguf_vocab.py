"""What a GGUF's vocabulary says about how a turn ends and how a chat is written.

End of generation: llama.cpp stops on more than `tokenizer.ggml.eos_token_id`. Its vocabulary
loader also treats as end-of-generation the ids in `tokenizer.ggml.eot_token_id` /
`eom_token_id` and any control token whose text is one of the known end-of-turn markers
(Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>`, ...). HF checkpoints
say the same through generation_config.json's eos list (Gemma 3: [1, 106]); a GGUF carries no
generation_config, so the ids are found here the way llama.cpp finds them.

Chat template: GGUF converters copy the HF tokenizer's template into `tokenizer.chat_template`
when there is one. Some files (base-model conversions) carry none; for an architecture whose
turn format is fixed by its tokenizer (Gemma 3's `<start_of_turn>`/`<end_of_turn>`), the
architecture's own template is used instead (edgellm/data/chat_templates/), as llama.cpp's
built-in templates do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the end-of-turn texts llama.cpp's vocabulary loader recognises (llama-vocab.cpp)
END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<EOT>",
        "_<EOT>",
        "<｜end▁of▁sentence｜>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "[|endofturn|]",
    }
)
_CONTROL = 3  # llama.cpp's token type for control tokens
_TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
# GGUF architecture -> its template file when the GGUF has none
_ARCH_TEMPLATES = {"gemma3": "gemma3.jinja"}


def end_of_generation_ids(fields: dict[str, Any]) -> list[int]:
    """eos first, then the eot/eom ids, then control tokens with an end-of-turn text; no repeats."""
    out: list[int] = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        value = fields.get(key)
        if value is not None and int(value) not in out:
            out.append(int(value))
    tokens = fields.get("tokenizer.ggml.tokens") or []
    types = fields.get("tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == _CONTROL and text in END_OF_TURN_TEXTS and i not in out:
            out.append(i)
    return out


def fallback_chat_template(gguf_arch: str, fields: dict[str, Any]) -> str | None:
    """The architecture's own template when the file carries none (None otherwise)."""
    if fields.get("tokenizer.chat_template") or gguf_arch not in _ARCH_TEMPLATES:
        return None
    return (_TEMPLATES / _ARCH_TEMPLATES[gguf_arch]).read_text()
