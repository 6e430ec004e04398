"""End-of-generation ids and the fallback chat template read from a GGUF's vocabulary
(edgellm/quant/gguf_vocab.py), as llama.cpp's vocabulary loader finds them."""

from __future__ import annotations

from edgellm.quant.gguf_vocab import end_of_generation_ids, fallback_chat_template

_CONTROL, _NORMAL = 3, 1


def _fields(tokens, types, **ids):
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            **{f"tokenizer.ggml.{k}": v for k, v in ids.items()}}


def test_control_tokens_with_end_of_turn_texts_end_generation_after_eos():
    tokens = ["<pad>", "<eos>", "<bos>", "<end_of_turn>", "<|im_end|>", "hello", "<end_of_turn>"]
    types = [_CONTROL, _CONTROL, _CONTROL, _CONTROL, _NORMAL, _NORMAL, _NORMAL]
    # a normal token spelled like a marker is text, not an end of turn
    assert end_of_generation_ids(_fields(tokens, types, eos_token_id=1)) == [1, 3]
    assert end_of_generation_ids(_fields(tokens, types, eos_token_id=1, eot_token_id=5)) == [1, 5, 3]
    assert end_of_generation_ids(_fields(tokens, types, eos_token_id=3)) == [3]
    assert end_of_generation_ids({}) == []


def test_gemma3_files_without_a_template_get_gemmas_own():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = fallback_chat_template("gemma3", {})
    assert template is not None
    assert fallback_chat_template("gemma3", {"tokenizer.chat_template": "{{ x }}"}) is None
    assert fallback_chat_template("llama", {}) is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    rendered, _ = render_jinja_template(conversations=[msgs], chat_template=template,
                                        add_generation_prompt=True, bos_token="<bos>")
    assert rendered[0] == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                           "<start_of_turn>model\nHello.<end_of_turn>\n"
                           "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
