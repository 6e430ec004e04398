"""The CUDA path of every format (the Triton kernels, repacked once at load), run end to
end on CPU tensors under the Triton interpreter: EDGELLM_TRITON_ON_CPU=1 makes the
loader pick the kernels a GPU would. Compared with the exact CPU path of the same
checkpoints. (A subprocess: TRITON_INTERPRET must be set before triton is imported.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm import LLM
from tests.helpers.gguf_files import Q4_K_M, write_llama_gguf
from tests.helpers.quant_tiny import quantize_checkpoint, quantize_w8a8

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 12, 200, 1]

CHILD = r"""
import json, sys, torch
from edgellm import LLM
out = {}
for path in json.loads(sys.argv[1]):
    llm = LLM(path, kv_cache_memory=1 << 20)
    kernels = sorted({type(m.kernel).__name__ for m in llm.engine.model.modules() if hasattr(m, "kernel")})
    logits = llm.prompt_logits([json.loads(sys.argv[2])])[0]
    out[path] = {"kernels": kernels, "logits": logits.tolist()}
print("RESULT" + json.dumps(out))
"""


def _kquant_llama():
    """A tiny Llama wide enough for the K-quants' 256-weight super-blocks."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.05, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    made = {}
    src, hf = tiny_dir("llama")
    made["awq"] = quantize_checkpoint(src, hf, root / "awq", "awq", sym=False)[0]
    made["gptq-act-order"] = quantize_checkpoint(src, hf, root / "gptq", "gptq", sym=False, desc_act=True)[0]
    made["fp8-static"] = quantize_w8a8(src, hf, root / "fp8", "fp8", weight_strategy="tensor",
                                       activations="tensor")[0]
    made["int8-w8a8"] = quantize_w8a8(src, hf, root / "int8", "int8")[0]
    made["int8-w8a16"] = quantize_w8a8(src, hf, root / "int8wo", "int8", activations=None)[0]
    made["gguf-q4_k_m"] = write_llama_gguf(_kquant_llama(), root / "tiny-q4_k_m.gguf", Q4_K_M,
                                           embed_type="F32")[0]
    src, hf = tiny_dir("phi3")
    made["ct-int4-phi3"] = quantize_checkpoint(src, hf, root / "ct", "ct_int4", sym=False)[0]
    return made


def test_triton_kernels_match_the_exact_cpu_path(checkpoints):
    paths = {name: str(p) for name, p in checkpoints.items()}
    env = dict(os.environ, TRITON_INTERPRET="1", EDGELLM_TRITON_ON_CPU="1", EDGELLM_CPU_QUANT="exact")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(list(paths.values())), json.dumps(PROMPT)],
                          capture_output=True, text=True, env=env, check=False, cwd=Path(__file__).resolve().parents[2],
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    expected = {"awq": ["TritonInt4Kernel"], "gptq-act-order": ["TritonInt4Kernel"],
                "ct-int4-phi3": ["TritonInt4Kernel"], "fp8-static": ["FP8Kernel"],
                "int8-w8a8": ["Int8W8A8Kernel"], "int8-w8a16": ["Int8WeightOnlyKernel"],
                # Q4_K linears as int4 with offsets; Q6_K and the mixed Q4_K/Q6_K qkv as int8 codes
                "gguf-q4_k_m": ["TritonInt4Kernel", "TritonInt8GroupedKernel"]}
    for name, path in paths.items():
        got = torch.tensor(result[path]["logits"])
        want = LLM(path, kv_cache_memory=1 << 20, cpu_quant="exact").prompt_logits([PROMPT])[0]
        assert result[path]["kernels"] == expected[name], name
        err = ((got - want).abs().amax(-1) / want.abs().max())
        if name == "int8-w8a8":  # fp32 vs int32 accumulation: rare rounding-tie flips downstream
            assert (err < 1e-4).float().mean() > 0.75 and err.max() < 0.02, (name, err)
        else:
            assert err.max() < 1e-4, (name, err)
