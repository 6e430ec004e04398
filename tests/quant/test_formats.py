"""Every checkpoint format through the one QuantScheme interface, on tiny Llama, Qwen2
and Phi-3 models quantized here the way the tools write them (tests/helpers/quant_tiny.py).

The exact CPU path must equal transformers running the dequantized weights (fp32;
in practice bit for bit); the fast CPU path (int4 GEMV or a bf16 matmul, bf16
activations) must stay as close as a bf16 model does; the auto path (integer dots) must equal
transformers with each quantized linear's input rounded to int8 by the reference rule. Unsupported formats and options fail at load with a
message naming them.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgellm import LLM
from edgellm.kernels.reference import dequantize_rows_ref, quantize_rows_ref
from edgellm.loader import CheckpointError
from edgellm.models.arch import LLAMA
from tests.helpers.quant_tiny import quantize_checkpoint, quantize_w8a8

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 12, 200, 1, 64, 33, 7, 19, 280, 2, 91]

INT4_CASES = [
    # arch, format, options
    ("phi3", "awq", {"sym": False}),  # fused qkv/gate_up on disk, output dim 1
    ("phi3", "awq", {"sym": False, "split": True}),  # gate_up and qkv split on disk
    ("phi3", "gptq", {"sym": True, "desc_act": True}),
    ("phi3", "gptq", {"sym": False, "split": True, "desc_act": True, "shard_g_idx": True}),
    ("phi3", "ct_int4", {"sym": True, "split": True}),
    ("phi3", "ct_int4", {"sym": False}),
    ("qwen2", "awq", {"sym": False, "ignore": ("down_proj",)}),  # q/k/v biases stay float
    ("qwen2", "gptq", {"sym": True, "ignore": ("o_proj",)}),
    ("qwen2", "gptq_v2", {"sym": False}),
    ("qwen2", "ct_int4", {"sym": False, "desc_act": True}),
    ("llama", "gptq", {"sym": False, "desc_act": True}),
    ("qwen3", "awq", {"sym": False}),  # q/k norms after quantized projections
    ("gemma3", "gptq", {"sym": True}),  # sandwich norms, GeGLU, sliding + global rotary
    ("exaone4", "ct_int4", {"sym": False}),  # post-norms, a layer without rotary
]


def _ids(case) -> str:
    arch, fmt, opts = case
    return "-".join([arch, fmt] + [k if v is True else f"{k}={v}" for k, v in opts.items() if v])


def _kernels(llm: LLM) -> set[str]:
    return {type(m.kernel).__name__ for m in llm.engine.model.modules() if hasattr(m, "kernel")}


@pytest.fixture(scope="module", params=INT4_CASES, ids=_ids)
def int4_case(request, tiny_dir, tmp_path_factory):
    arch, fmt, opts = request.param
    src, hf = tiny_dir(arch)
    dst, ref = quantize_checkpoint(src, hf, tmp_path_factory.mktemp("q") / "ckpt", fmt, **opts)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    return request.param, dst, want, ref


def test_int4_exact_path_equals_transformers_on_dequantized_weights(int4_case):
    _, path, want, _ = int4_case
    llm = LLM(str(path), kv_cache_memory=1 << 20, cpu_quant="exact")
    got = llm.prompt_logits([PROMPT])[0]
    assert _kernels(llm) == {"DenseKernel"}
    assert (got - want).abs().max().item() < 1e-4


def test_int4_fast_path_runs_packed_and_stays_close(int4_case, monkeypatch):
    (_, _, opts), path, want, _ = int4_case
    monkeypatch.setenv("EDGELLM_CPU_QUANT", "fast")
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_batched_tokens=6)  # GEMV-sized steps
    got = llm.prompt_logits([PROMPT])[0]
    kernels = _kernels(llm)
    assert "CpuInt4Kernel" in kernels
    # only fused modules whose shards have different act-order permutations stay dense
    assert kernels == {"CpuInt4Kernel"} or opts.get("shard_g_idx")
    err = (got - want).abs().max() / want.abs().max()
    assert 0 < err < 0.05  # the same bound a bf16 model meets (test_models)


def _int8_activations(ref: torch.nn.Module, ckpt: Path, ignore: tuple[str, ...]) -> torch.nn.Module:
    """`ref` with every quantized linear's input rounded as the integer-dot kernel rounds it
    (edgellm/kernels/reference.quantize_rows_ref, per 32 columns, in act-order's column order)."""
    tensors = load_file(ckpt / "model.safetensors")
    model = copy.deepcopy(ref)

    def hook_for(perm: torch.Tensor | None):
        def hook(module, args):
            (x,) = args
            x2 = x.reshape(-1, x.shape[-1]).float()
            xp = x2 if perm is None else x2[:, perm]
            codes, d, _ = quantize_rows_ref(xp.contiguous(), 32)
            q = dequantize_rows_ref(codes, d)
            if perm is not None:
                q = torch.empty_like(q).index_copy_(1, perm, q)
            return (q.reshape(x.shape),)
        return hook

    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, torch.nn.Linear) and leaf != "lm_head" and leaf not in ignore:
            g_idx = tensors.get(f"{name}.g_idx", tensors.get(f"{name}.weight_g_idx"))
            perm = None if g_idx is None else torch.argsort(g_idx.long(), stable=True)
            module.register_forward_pre_hook(hook_for(perm))
    return model


def test_int4_auto_path_is_integer_dots_over_rounded_activations(int4_case):
    """The default CPU mode keeps the codes and runs integer dots over int8 activations, in one
    step of the whole prompt and in GEMV-sized steps alike (the int-dot kernels forced at every
    size: calibration may hand large steps to the exact dense matmul where that measured faster).

    Inside the model, every call of every int-dot linear equals the plain reference on the input
    it received (edgellm/kernels/reference.int_linear_ref: that input rounded by quantize_rows_ref, times
    the dequantized weight). End to end, the logits are those of transformers with each quantized
    linear's input rounded the same way, far closer to them than the exact model is: fp32 noise
    upstream can move an activation across a rounding boundary (one code off by one), and through
    attention that touches every later position, so the end-to-end check is relative, not 1e-5."""
    from edgellm.kernels.reference import int_linear_ref, unpack_int4_blocks_ref, unpack_int_n16_ref

    def weight_of(k):  # codes, scale, offset [N, ...] from the kernel's layout (rows, or n16 on VNNI)
        if not k.n16:
            return unpack_int4_blocks_ref(k.qweight), k.scale.float(), k.offset.float()
        def rows(t):
            return t.float().transpose(1, 2).reshape(-1, t.shape[1])[: k.n]
        # symmetric codes are stored - 8 under zero 8, with no offsets
        offset = rows(k.offset) if k.offset.numel() else None
        return unpack_int_n16_ref(k.qweight, k.n, 4, k.zero), rows(k.scale), offset

    (_, _, opts), path, want, ref = int4_case
    # fused modules whose shards have different act-order permutations stay dense (exact)
    dense = ("qkv_proj", "gate_up_proj") if opts.get("shard_g_idx") else ()
    ref = _int8_activations(ref, path, opts.get("ignore", ()) + dense)
    with torch.no_grad():
        want_q = ref(torch.tensor([PROMPT])).logits[0]
    for step_tokens in (None, 6):
        kw = {} if step_tokens is None else {"max_num_batched_tokens": step_tokens}
        # capped at avx2: fp32 prompt attention on every CPU (with bf16 units auto attends in bf16,
        # which the end-to-end bound below does not cover); the integer dots are the same code.
        # fp32 pages: the bound is the int8 activations' alone (fp16 pages: tests/engine/test_kv_dtype.py)
        llm = LLM(str(path), kv_cache_memory=1 << 20, cpu_quant="auto", cpu_isa="avx2", kv_cache_dtype="fp32", **kw)
        kernels = [m.kernel for m in llm.engine.model.modules() if hasattr(m, "kernel")]
        assert {type(k).__name__ for k in kernels} == {"CpuIntDotKernel"} | ({"DenseKernel"} if dense else set())
        calls: list[tuple] = []

        def recording(kernel, run):
            def int_dot(x2, bias):
                y = run(x2, bias)
                calls.append((kernel, x2.clone(), bias, y.clone()))  # later ops (rotary) work in place
                return y
            return int_dot

        for k in kernels:
            if type(k).__name__ == "CpuIntDotKernel":
                k.max_rows = 1 << 62
                k.int_dot = recording(k, k.int_dot)
        got = llm.prompt_logits([PROMPT])[0]
        assert len(calls) >= len(kernels) - (4 if dense else 0)
        for k, x2, bias, y in calls:
            exp = int_linear_ref(x2, *weight_of(k), k.group, bias)
            assert (y.double() - exp).abs().max() <= 1e-5 * exp.abs().max()
        scale = want.abs().max()
        to_rounded, exact_to_rounded = (got - want_q).abs().max() / scale, (want - want_q).abs().max() / scale
        assert exact_to_rounded > 1e-2 and to_rounded < exact_to_rounded / 2, (to_rounded, exact_to_rounded)


@pytest.mark.parametrize("dense_cache_mb", ["2048", "0"])
def test_int4_fast_path_larger_steps(int4_case, monkeypatch, dense_cache_mb):
    """Steps of more rows than the GEMV takes use the dequantized matrix: kept from load in bf16
    within the budget (EDGELLM_CPU_DENSE_CACHE_MB), else dequantized per call (exact fp32 for
    fp32 inputs). The model stays as close as a bf16 model either way (prefill attention and the
    MLP intermediate run in bf16 in fast mode too)."""
    _, path, _, _ = int4_case
    long_prompt = (PROMPT * 8)[:140]  # over GEMV_MAX_ROWS_UNCACHED too
    monkeypatch.setenv("EDGELLM_CPU_QUANT", "exact")
    want = LLM(str(path), kv_cache_memory=1 << 20).prompt_logits([long_prompt])[0]
    monkeypatch.setenv("EDGELLM_CPU_QUANT", "fast")
    monkeypatch.setenv("EDGELLM_CPU_DENSE_CACHE_MB", dense_cache_mb)
    llm = LLM(str(path), kv_cache_memory=1 << 20)
    kernels = [m.kernel for m in llm.engine.model.modules() if type(getattr(m, "kernel", None)).__name__ == "CpuInt4Kernel"]
    assert kernels and all((k.dense_weight is None) == (dense_cache_mb == "0") for k in kernels)
    assert all(k.dense_weight.dtype == torch.bfloat16 for k in kernels if k.dense_weight is not None)
    got = llm.prompt_logits([long_prompt])[0]
    err = (got - want).abs().max().item()
    assert 0 < err / want.abs().max().item() < 0.05  # the bound a bf16 model meets
    g = torch.Generator().manual_seed(1)
    for k in kernels:
        x = torch.randn(140, k.k, generator=g)
        exact = torch.nn.functional.linear(x[:, k.perm] if k.perm is not None else x, k.dense())  # stored order
        y = k(x, None)
        if dense_cache_mb == "0":
            assert (y - exact).abs().max().item() < 1e-4  # dequantized per call, fp32
        else:
            assert 0 < (y - exact).abs().max().item() < 2e-2 * exact.abs().max().item()


W8A8_CASES = [
    ("llama", "fp8", "tensor", "tensor"),  # per-tensor weight and input scales differ across q/k/v
    ("llama", "int8", "tensor", "tensor"),
    ("qwen2", "fp8", "channel", "token"),
    ("phi3", "int8", "channel", "token"),
    ("phi3", "fp8", "tensor", None),  # weight-only fp8
    ("llama", "int8", "channel", None),  # weight-only int8
]


@pytest.mark.parametrize("arch,kind,weights,acts", W8A8_CASES)
def test_w8a8_equals_transformers_with_fake_quantized_activations(arch, kind, weights, acts, tiny_dir,
                                                                  tmp_path):
    src, hf = tiny_dir(arch)
    dst, ref = quantize_w8a8(src, hf, tmp_path / "ckpt", kind, weight_strategy=weights, activations=acts)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(str(dst), kv_cache_memory=1 << 20, cpu_quant="exact")  # fp32 attention on every CPU
    got = llm.prompt_logits([PROMPT])[0]
    per_position = (got - want).abs().amax(-1)
    if kind == "int8" and acts is not None:  # int32 vs fp32 accumulation: rare rounding-tie flips
        assert (per_position < 1e-4).float().mean() > 0.75
        assert (per_position.max() / want.abs().max()).item() < 0.02
    else:
        assert per_position.max().item() < 1e-4


# -- failures that name the problem ---------------------------------------------------------


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def gptq_llama(tiny_dir, tmp_path_factory):
    src, hf = tiny_dir("llama")
    return quantize_checkpoint(src, hf, tmp_path_factory.mktemp("g") / "ckpt", "gptq", desc_act=True)[0]


@pytest.mark.parametrize("changes,message", [
    ({"bits": 3}, r"bits=3"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
    ({"lm_head": True}, r"quantized lm_head"),
    ({"quant_method": "hqq"}, r"'hqq' is not supported"),
])
def test_unsupported_gptq_options_fail_at_load(gptq_llama, tmp_path, changes, message):
    dst = _with_config(gptq_llama, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_act_order_without_g_idx_is_an_error(gptq_llama, tmp_path):
    dst = tmp_path / "no-gidx"
    shutil.copytree(gptq_llama, dst)
    t = load_file(dst / "model.safetensors")
    save_file({k: v for k, v in t.items() if not k.endswith(".g_idx")}, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: .*g_idx"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_nonzero_bias_for_a_biasless_layer_is_an_error(gptq_llama, tmp_path):
    dst = tmp_path / "bias"
    shutil.copytree(gptq_llama, dst)
    t = load_file(dst / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(t, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"o_proj has no bias"):
        LLM(str(dst), kv_cache_memory=1 << 20)


@pytest.mark.parametrize("fmt,changes,message", [
    ("awq", {"version": "gemv"}, r"version 'gemv'"),
    ("awq", {"zero_point": False}, r"zero_point=false"),
    ("ct_int4", {"format": "marlin-24"}, r"format 'marlin-24'"),
    ("ct_int4", {"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity_config"),
])
def test_unsupported_options_of_other_formats_fail_at_load(tiny_dir, tmp_path, fmt, changes, message):
    src, hf = tiny_dir("llama")
    ckpt, _ = quantize_checkpoint(src, hf, tmp_path / "ok", fmt, sym=False)
    if "format" in changes:  # compressed-tensors: the group's format decides
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["format"] = changes["format"]
        (ckpt / "config.json").write_text(json.dumps(cfg))
    dst = _with_config(ckpt, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_ignoring_one_shard_of_a_fused_module_is_an_error(tiny_dir, tmp_path):
    src, hf = tiny_dir("llama")
    with pytest.raises(ValueError, match=r"v_proj are left unquantized.*qkv_proj"):
        dst, _ = quantize_checkpoint(src, hf, tmp_path / "ckpt", "ct_int4", ignore=("v_proj",))
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_tensor_names_split_at_the_longest_known_module():
    modules = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn", "model.layers.0.mlp"}
    t = LLAMA.map_tensor_name("model.layers.0.self_attn.q_proj.weight.absmax", modules)
    assert (t.module, t.param, t.shard) == ("model.layers.0.self_attn.qkv_proj", "weight.absmax", "q")
    t = LLAMA.map_tensor_name("model.layers.0.self_attn.k_proj.weight.quant_state.bitsandbytes__nf4", modules)
    assert (t.module, t.param, t.shard) == ("model.layers.0.self_attn.qkv_proj",
                                            "weight.quant_state.bitsandbytes__nf4", "k")
    t = LLAMA.map_tensor_name("model.layers.0.self_attn.k_scale", modules)
    assert (t.module, t.param) == ("model.layers.0.self_attn", "k_scale")
    t = LLAMA.map_tensor_name("model.layers.0.mlp.extra_proj.weight", {"model.layers.0.self_attn"})
    assert (t.module, t.param) == ("model.layers.0.mlp.extra_proj", "weight")  # unknown: last dot
