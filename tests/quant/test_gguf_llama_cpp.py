"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py from the llama.cpp that
llama-cpp-python's sdist vendors), run on tiny transformers models of every architecture with a
GGUF mapping: edgellm loads each file alone, with no HF directory, and matches transformers on the
original model.

- f32 files: prompt logits within fp32 tolerance over prompts longer than the sliding windows
  (and, for Phi-4-mini, longer than the longrope switch), and greedy tokens equal;
- q8_0 files (linears kept quantized): equal to transformers with the file's dequantized weights.

Slow tier: the first run downloads the sdist from the package registry.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.bench.llama_cpp import converter_dir
from tests.helpers.tiny_models import build_tiny

pytestmark = pytest.mark.slow

CONVERT = Path(__file__).resolve().parents[1] / "helpers" / "llama_cpp_convert.py"
ARCHS = {"llama32": "llama", "qwen3": "qwen3", "gemma3_6": "gemma3", "exaone4": "exaone4",
         "phi4mini": "phi3", "phi3": "phi3"}


@pytest.fixture(scope="module")
def llama_cpp() -> Path:
    return converter_dir()


def _convert(llama_cpp: Path, arch: str, tmp: Path, outtype: str) -> tuple[Path, torch.nn.Module]:
    model_dir, hf = build_tiny(arch, tmp / arch, seed=3)
    out = tmp / f"{arch}-{outtype}.gguf"
    proc = subprocess.run([sys.executable, str(CONVERT), str(llama_cpp), str(model_dir), str(out), outtype],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, hf


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 40, 61)]


def _check(llm: LLM, hf: torch.nn.Module, tol: float = 1e-4) -> None:
    for ids in _prompts(hf.config.vocab_size):
        ours = llm.prompt_logits([ids])[0].float()
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float()
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= tol * scale, len(ids)
    ids = _prompts(hf.config.vocab_size)[1]
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out[0].outputs[0].token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_llama_cpp_f32_file_equals_transformers(llama_cpp, arch, tmp_path):
    path, hf = _convert(llama_cpp, arch, tmp_path, "f32")
    llm = LLM(str(path), cpu_quant="exact", max_model_len=256)
    assert llm.engine.checkpoint.gguf.gguf_arch == ARCHS[arch]
    _check(llm, hf)


def _dequantized_reference(path: Path, hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every weight replaced by the GGUF file's (Q8_0 linears and embedding dequantized
    by gguf-py)."""
    from edgellm.quant.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    state = dict(ckpt.tensors(keep_quantized=False))
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, w in state.items():
            if name in params:
                params[name].copy_(w)
    return hf


@pytest.mark.parametrize("arch", ["llama32", "phi4mini"])
def test_llama_cpp_q8_0_file_kept_quantized(llama_cpp, arch, tmp_path):
    path, hf = _convert(llama_cpp, arch, tmp_path, "q8_0")
    llm = LLM(str(path), cpu_quant="exact", max_model_len=256)
    assert llm.engine.checkpoint.gguf.linear_types  # the linears stay Q8_0 blocks
    _check(llm, _dequantized_reference(path, hf))
