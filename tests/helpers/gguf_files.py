"""Tiny llama.cpp-style GGUF files for the tests: a transformers Llama model's tensors written
with gguf-py's writer, q/k rows permuted like llama.cpp's converter, each linear in a chosen
GGML type. gguf-py quantizes the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the K-quants it
only reads, so Q4_K and Q6_K are encoded here by a simple min/max rule (not llama.cpp's search:
the tests need valid blocks near the weights, and take gguf-py's dequantization of whatever
was written as the reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgellm.bench.gguf_rows import FP16_AT, random_rows  # noqa: F401  (re-exported for the tests)

HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q4_K blocks [N * K / 256, 144] uint8."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    safe = lambda v: np.where(v > 0, v, 1.0)
    sc = np.clip(np.rint(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(
        np.rint((x + (dmin[:, None] * m)[..., None]) / safe(step)[..., None]), 0, 15
    ).astype(np.uint8)
    scales = np.zeros((len(x), 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk i: sub-block 2i in the low nibbles, 2i + 1 in the high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], 1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q6_K blocks [N * K / 256, 210] uint8."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = (
        np.clip(np.rint(x / np.where(step != 0, step, 1.0)[..., None]), -32, 31).astype(np.int16)
        + 32
    )
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 elements
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    h = high.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], 1)


ENCODERS = {"Q4_K": encode_q4_k, "Q6_K": encode_q6_k}


def _add_byte_tokenizer(writer, vocab_size: int) -> None:
    """A GPT-2-style byte-level BPE with no merges: the 256 byte tokens, an end-of-text token,
    and fillers up to the model's vocabulary (so the engine has a real tokenizer to load)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> printable character table
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tokens = [chars[b] for b in range(256)] + ["<|endoftext|>"]
    tokens += [f"<|filler_{i}|>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (vocab_size - 256))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_eos_token_id(256)
    writer.add_bos_token_id(256)


def write_llama_gguf(
    hf_model, path: Path, types: dict[str, str] | list[dict[str, str]], embed_type: str = "Q8_0"
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write `hf_model` (a transformers Llama) as a GGUF at `path`, each linear in the GGML type
    `types[short name]` (one dict for every layer, or one per layer). Returns (path, {HF linear
    name: the fp32 weight gguf-py dequantizes from the file, in HF row order})."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)
    _add_byte_tokenizer(writer, cfg.vocab_size)
    state = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    per_layer = types if isinstance(types, list) else [types] * cfg.num_hidden_layers
    reference = {}

    def put(name: str, w: np.ndarray, type_name: str) -> np.ndarray:
        qtype = T[type_name]
        if type_name == "F32":
            writer.add_tensor(name, w.astype(np.float32))
            return w
        if type_name in ENCODERS:
            blocks = ENCODERS[type_name](w).reshape(w.shape[0], -1)
        else:
            blocks = gguf.quants.quantize(w.astype(np.float32), qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        return gguf.quants.dequantize(blocks, qtype).reshape(w.shape)

    put("token_embd.weight", state["model.embed_tokens.weight"], embed_type)
    put("output_norm.weight", state["model.norm.weight"], "F32")
    put("output.weight", state["lm_head.weight"], "F32")
    for i in range(cfg.num_hidden_layers):
        put(f"blk.{i}.attn_norm.weight", state[f"model.layers.{i}.input_layernorm.weight"], "F32")
        put(
            f"blk.{i}.ffn_norm.weight",
            state[f"model.layers.{i}.post_attention_layernorm.weight"],
            "F32",
        )
        for short, type_name in per_layer[i].items():
            hf_name = f"model.layers.{i}.{HF[short]}"
            w = state[f"{hf_name}.weight"]
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(
                short
            )
            if heads:
                w = permute(w, heads)
            deq = put(f"blk.{i}.{short}.weight", w, type_name)
            if heads:  # undo the permutation: the HF row order
                deq = (
                    deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1)
                    .swapaxes(1, 2)
                    .reshape(deq.shape)
                )
            reference[hf_name] = torch.from_numpy(np.ascontiguousarray(deq))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference


Q4_K_M = [  # layer 0 takes the higher-precision v/down, as llama-quantize does for the first layers
    {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q6_K",
    },
    {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q4_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q4_K",
    },
]
