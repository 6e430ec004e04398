"""Quantized GEMMs: int4 layouts (pack/unpack/repack exactness, real community
checkpoints), W4A16 / W8A16 / FP8 Triton kernels vs dequantize-then-fp32-matmul.

Without CUDA the kernels run on CPU tensors under Triton's interpreter
(tests/helpers/triton_device.py).
"""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels import dequant_gemm as dq
from edgellm.kernels import fp8_gemm as f8
from edgellm.kernels import int4_layouts as L
from edgellm.kernels import int8_gemm as i8
from tests.helpers.fixture_paths import FIXTURES
from tests.helpers.triton_device import DEVICE

pytestmark = pytest.mark.usefixtures("triton_device")


FP8 = torch.float8_e4m3fn
# relative to the output's largest magnitude; fp16/bf16 also round the output (and W)
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOL)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    assert scale > 0
    torch.testing.assert_close(
        out.float().cpu(), ref.float().cpu(), rtol=TOL[dtype], atol=TOL[dtype] * scale
    )


def rand_int4(n: int, k: int, group: int, seed: int, zeros: bool = True):
    """Unpacked convention: q [N, K], zeros [N, G] (None: symmetric), scales [N, G] fp16."""
    g = gen(seed)
    groups = k // group
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    z = torch.randint(1, 16, (n, groups), generator=g, dtype=torch.int32) if zeros else None
    s = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half()
    return q, z, s


def desc_act_g_idx(k: int, group: int, seed: int) -> torch.Tensor:
    """GPTQ desc_act: each group has `group` rows, scattered over K."""
    return (torch.argsort(torch.rand(k, generator=gen(seed))) // group).to(torch.int32)


# -- int4 layouts --


def test_bit_packing_known_words():
    codes = torch.arange(8, dtype=torch.int32)[None, :]
    assert L.pack_int4(codes, 1).item() == 0x76543210
    assert L.pack_awq(codes.t(), codes.t(), torch.ones(8, 1))["qweight"].item() == 0x75316420
    high = torch.full((8, 1), 15, dtype=torch.int32)  # all-ones word is -1 as int32
    assert L.pack_int4(high, 0).item() == -1
    g = gen(0)
    for dim, shape in ((0, (24, 5)), (1, (3, 40))):
        c = torch.randint(0, 16, shape, generator=g)
        assert torch.equal(L.unpack_int4(L.pack_int4(c, dim), dim), c.int())


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_desc_act", "ct_sym", "ct_asym", "ct_g_idx"])
def test_pack_unpack_repack_exact(fmt):
    n, k, group = 40, 256, 64
    q, z, s = rand_int4(
        n, k, group, seed=1, zeros=fmt in ("awq", "gptq", "gptq_desc_act", "ct_asym")
    )
    g_idx = desc_act_g_idx(k, group, 2) if fmt in ("gptq_desc_act", "ct_g_idx") else None
    truth = L.dequant_int4_ref(q, z, s, group, g_idx)
    if fmt == "awq":
        t = L.pack_awq(q, z, s)
        assert t["qweight"].shape == (k, n // 8) and t["qzeros"].shape == (k // group, n // 8)
        q2, z2 = L.awq_codes(t["qweight"], t["qzeros"])
        assert torch.equal(q2, q) and torch.equal(z2, z)
        w, canon = L.unpack_awq(**t, group_size=group), L.repack_awq(**t, group_size=group)
    elif fmt.startswith("gptq"):
        t = L.pack_gptq(q, z, s, group, g_idx)
        assert t["qweight"].shape == (k // 8, n) and t["qzeros"].shape == (k // group, n // 8)
        q2, z2 = L.gptq_codes(t["qweight"], t["qzeros"])
        assert torch.equal(q2, q) and torch.equal(z2, z)
        w, canon = L.unpack_gptq(**t), L.repack_gptq(**t, group_size=group)
    else:
        t = L.pack_ct_int4(q, s, z)
        assert t["weight_packed"].shape == (n, k // 8) and t["weight_shape"].tolist() == [n, k]
        args = {key: v for key, v in t.items() if key != "weight_shape"}
        w = L.unpack_ct_int4(**args, g_idx=g_idx)
        canon = L.repack_ct_int4(**args, g_idx=g_idx)
    assert torch.equal(w, truth)
    assert torch.equal(L.unpack_int4_weight(canon), truth)
    assert canon.qweight.shape == (k // 8, n) and canon.scales.shape == (k // group, n)
    assert (canon.zeros is None) == (z is None)
    if g_idx is not None:  # sorted into whole groups: a row permutation, no per-row gather
        assert canon.perm is not None and canon.g_idx is None


def test_gptq_symmetric_zeros_and_irregular_g_idx():
    n, k, group = 16, 128, 32
    q, _, s = rand_int4(n, k, group, seed=3, zeros=False)
    t = L.pack_gptq(q, None, s, group)
    assert (t["qzeros"] == 0x77777777).all()  # the community encoding of zero 8
    canon = L.repack_gptq(**t, group_size=group)
    assert canon.zeros is None and canon.g_idx is None and canon.perm is None
    g_idx = torch.randint(
        0, k // group, (k,), generator=gen(4), dtype=torch.int32
    )  # unequal groups
    t = L.pack_gptq(q, None, s, group, g_idx)
    canon = L.repack_gptq(**t, group_size=group)
    assert canon.g_idx is not None and canon.perm is None
    assert torch.equal(L.unpack_int4_weight(canon), L.dequant_int4_ref(q, None, s, group, g_idx))


# -- real checkpoints --


def _load(name: str) -> dict[str, torch.Tensor]:
    path = FIXTURES / name / "model.safetensors"
    if not path.exists():
        pytest.skip(f"fixture {name} not available")
    from safetensors.torch import load_file

    return load_file(str(path))


LINEARS = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fixtures_dequantize_to_base_weights():
    """GPTQModel, llm-compressor and AutoAWQ made these from one base model: a right
    layout reading gives int4 quantization error (~0.13), a wrong one garbage (> 0.3)."""
    base, gptq = _load("base/llama"), _load("gptqmodel_gptq_w4g128_sym")
    ct, awq = _load("llmcompressor_w4a16_gptq"), _load("autoawq_gemm_w4g128")
    for name in LINEARS:
        ref = base[name + ".weight"].float()
        gq = {k: gptq[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        cq = {k: ct[f"{name}.{k}"] for k in ("weight_packed", "weight_scale")}
        aq = {k: awq[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales")}
        assert ct[name + ".weight_shape"].tolist() == list(ref.shape)
        for w in (L.unpack_gptq(**gq), L.unpack_ct_int4(**cq), L.unpack_awq(**aq, group_size=128)):
            assert w.shape == ref.shape and _rel(w, ref) < 0.2, name
        # negative controls: sequential AWQ nibbles, GPTQ zeros without the +1
        q, z = L.unpack_int4(aq["qweight"], 1).t(), L.unpack_int4(aq["qzeros"], 1).t()
        assert _rel(L.dequant_int4_ref(q, z, aq["scales"].t(), 128), ref) > 1.0
        q, z = L.unpack_int4(gq["qweight"], 0).t(), L.unpack_int4(gq["qzeros"], 1).t()
        assert _rel(L.dequant_int4_ref(q, z, gq["scales"].t(), 128), ref) > 0.3
        # repack is exact on real data too
        assert torch.equal(
            L.unpack_int4_weight(L.repack_gptq(**gq, group_size=128)), L.unpack_gptq(**gq)
        )
        assert torch.equal(L.unpack_int4_weight(L.repack_ct_int4(**cq)), L.unpack_ct_int4(**cq))
        assert torch.equal(
            L.unpack_int4_weight(L.repack_awq(**aq, group_size=128)),
            L.unpack_awq(**aq, group_size=128),
        )


def test_fixture_layers_through_kernels():
    """One real layer per format through its Triton kernel (fp16 activations)."""
    name = "model.layers.1.mlp.down_proj"  # K = 512, N = 256
    x = torch.randn(3, 512, generator=gen(5)).half().to(DEVICE)
    awq = _load("autoawq_gemm_w4g128")
    aq = {k: awq[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales")}
    w = L.repack_awq(**{k: v.to(DEVICE) for k, v in aq.items()}, group_size=128)
    close(
        dq.w4a16_gemm(x, **vars(w)),
        x.float() @ L.unpack_awq(**aq, group_size=128).to(DEVICE).t(),
        torch.float16,
    )
    int8 = _load("llmcompressor_w8a8_int8")
    wi, si = int8[name + ".weight"].to(DEVICE), int8[name + ".weight_scale"].to(DEVICE)
    close(i8.w8a16_gemm(x, wi, si), x.float() @ (wi.float() * si.float()).t(), torch.float16)
    fp8 = _load("llmcompressor_fp8_dynamic")
    wf, sf = fp8[name + ".weight"].to(DEVICE), fp8[name + ".weight_scale"].to(DEVICE)
    close(
        f8.fp8_gemm(x, wf, sf, use_fp8_activations=False),
        x.float() @ (wf.float() * sf.float()).t(),
        torch.float16,
    )


# -- W4A16 kernel --

W4_CASES = {  # name: (K, group, zeros, g_idx kind)
    "g64_asym": (256, 64, True, None),  # one scale row per K tile
    "g128_sym": (256, 128, False, None),
    "g32_asym": (256, 32, True, None),  # groups smaller than the tile: per-row scales
    "k200_g40": (200, 40, True, None),  # K tail inside a tile, groups straddle tiles
    "desc_act": (256, 64, True, "desc_act"),  # sorted at repack: x gathered through perm
    "irregular_g_idx": (256, 64, False, "random"),  # kept as g_idx: per-row scale gather
}


@pytest.mark.parametrize("case", list(W4_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 70])
def test_w4a16_gemm(case, dtype, m):
    k, group, has_zeros, gkind = W4_CASES[case]
    n = 40
    q, z, s = rand_int4(n, k, group, seed=10, zeros=has_zeros)
    g_idx = None
    if gkind == "desc_act":
        g_idx = desc_act_g_idx(k, group, 11)
    elif gkind == "random":
        g_idx = torch.randint(0, k // group, (k,), generator=gen(12), dtype=torch.int32)
    if dtype == torch.bfloat16:
        s = s.bfloat16()
    w_ref = L.dequant_int4_ref(q, z, s, group, g_idx)
    t = L.pack_gptq(q, z, s, group, g_idx)
    w = L.repack_gptq(**{key: v.to(DEVICE) for key, v in t.items()}, group_size=group)
    assert (w.perm is not None) == (gkind == "desc_act") and (w.g_idx is not None) == (
        gkind == "random"
    )
    x = torch.randn(m, k, generator=gen(13 + m)).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen(14)).to(dtype).to(DEVICE) if m != 3 else None
    ref = x.float() @ w_ref.to(DEVICE).t() + (bias.float() if bias is not None else 0)
    close(dq.w4a16_gemm(x, **vars(w), bias=bias), ref, dtype)
    cpu = {key: (v.cpu() if torch.is_tensor(v) else v) for key, v in vars(w).items()}
    close(dq.w4a16_gemm_ref(x.cpu(), **cpu, bias=None if bias is None else bias.cpu()), ref, dtype)


@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_w4a16_split_k_and_3d_input(split_k):
    n, k, group = 48, 384, 128
    q, z, s = rand_int4(n, k, group, seed=20)
    w = L.repack_int4(q.to(DEVICE), z.to(DEVICE), s.to(DEVICE), group)
    x = torch.randn(2, 3, k, generator=gen(21)).half().to(DEVICE)
    bias = torch.randn(n, generator=gen(22)).half().to(DEVICE)
    out = dq.w4a16_gemm(x, **vars(w), bias=bias, split_k=split_k)
    ref = x.float() @ L.dequant_int4_ref(q, z, s, group).to(DEVICE).t() + bias.float()
    assert out.shape == (2, 3, n)
    close(out, ref, torch.float16)


def test_w4a16_rejects_bad_shapes():
    q, z, s = rand_int4(16, 64, 32, seed=30)
    w = L.repack_int4(q, z, s, 32)
    with pytest.raises(ValueError):
        dq.w4a16_gemm(torch.randn(2, 72, dtype=torch.float16), **vars(w))
    with pytest.raises(ValueError):
        dq.w4a16_gemm(
            torch.randn(2, 64, dtype=torch.float16), **{**vars(w), "zeros": w.zeros.int()}
        )


# -- W8A16 kernel --


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m,split_k,per_tensor", [(1, None, False), (3, 2, True), (17, None, False), (70, None, True)]
)
def test_w8a16_gemm(dtype, m, split_k, per_tensor):
    n, k = 40, 200
    g = gen(40 + m)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(1 if per_tensor else n, 1, generator=g).half() * 0.01 + 0.001
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    ref = i8.w8a16_gemm_ref(x.float(), w, s, bias.float())
    x, w, s, bias = x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), bias.to(DEVICE)
    close(i8.w8a16_gemm(x, w, s, bias=bias, split_k=split_k), ref, dtype)


# -- FP8 --


def fp8_sm89() -> bool:
    return DEVICE == "cpu" or f8.fp8_activations_supported(torch.device(DEVICE))


def all_e4m3_values() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.uint8)
    return b[(b & 0x7F) != 0x7F].view(FP8).float()  # every finite code


def test_fp8_activation_quant_bit_exact():
    """Ties, binade edges, subnormals, saturation: the kernel's fp8 bytes equal torch's."""
    if not fp8_sm89():
        pytest.skip("fp8 activations need sm89+")
    v = all_e4m3_values().sort().values
    mids = (v[1:] + v[:-1]) / 2  # exact ties (round half to even decides)
    nudge = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    edges = 2.0 ** torch.arange(-12, 9).float()
    row = torch.cat(
        [v, mids, nudge, edges, -edges, torch.tensor([460.0, -1e4, 2**-11, 3 * 2**-11])]
    )
    x = torch.stack([row, row.flip(0) * 0.37]).to(DEVICE)
    xq, xs = f8.quant_fp8_per_token(
        x, input_scale=torch.ones(1, device=DEVICE)
    )  # static: ties stay ties
    rq, rs = f8.quant_fp8_per_token_ref(x, torch.ones(1))
    assert torch.equal(xq.view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(
        xs.cpu(), rs
    )
    g = gen(50)
    x = torch.randn(6, 333, generator=g) * (10.0 ** torch.arange(-4, 2).float())[:, None]
    x[4] = 0.0  # an all-zero row keeps a finite scale
    for dtype in DTYPES:
        xd = x.to(dtype)
        xq, xs = f8.quant_fp8_per_token(xd.to(DEVICE))
        rq, rs = f8.quant_fp8_per_token_ref(xd)
        assert torch.equal(xq.view(torch.uint8).cpu(), rq.view(torch.uint8)), dtype
        assert torch.equal(xs.cpu(), rs), dtype
        assert torch.isfinite(xq.float()).all()


def test_fp8_weight_decode_every_code():
    v = all_e4m3_values()
    k = 256
    vals = torch.cat([v, v[:2]])
    w = torch.stack([vals, vals.flip(0), -vals]).to(FP8)  # [N=3, K=256]
    eye = torch.eye(k).to(DEVICE)
    out = f8.fp8_gemm(eye, w.to(DEVICE), torch.ones(1, device=DEVICE), use_fp8_activations=False)
    assert torch.equal(out.cpu(), w.float().t())


FP8_CASES = [  # (act, m, weight scale, split_k); a static input_scale only exists for W8A8
    (act, m, kind, split)
    for act in (False, True)
    for m, kind, split in [
        (1, "channel", None),
        (3, "tensor", 2),
        (17, "channel", None),
        (70, "channel", None),
    ]
] + [(True, 5, "static", None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act,m,scale_kind,split_k", FP8_CASES)
def test_fp8_gemm(dtype, act, m, scale_kind, split_k):
    if act and not fp8_sm89():
        pytest.skip("fp8 activations need sm89+")
    n, k = 40, 192
    g = gen(60 + m)
    w = (torch.randn(n, k, generator=g) * 60).to(FP8)
    ws = (torch.rand(n if scale_kind == "channel" else 1, 1, generator=g) * 0.01 + 1e-3).to(dtype)
    if scale_kind != "channel":
        ws = ws.reshape(1)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if m != 3 else None
    input_scale = torch.tensor([0.02]) if scale_kind == "static" else None
    ref = f8.fp8_gemm_ref(
        x.float(), w, ws, input_scale, None if bias is None else bias.float(), act
    )

    def dev(t):
        return None if t is None else t.to(DEVICE)

    out = f8.fp8_gemm(
        dev(x),
        dev(w),
        dev(ws),
        dev(input_scale),
        dev(bias),
        use_fp8_activations=act,
        split_k=split_k,
    )
    close(out, ref, dtype)
    if not act:  # weight-only is plain dequantize-then-matmul
        close(
            out,
            x.float() @ (w.float() * ws.float().reshape(-1, 1)).t()
            + (0 if bias is None else bias.float()),
            dtype,
        )
