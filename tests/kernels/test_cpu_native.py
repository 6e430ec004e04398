"""The C++ CPU kernels (edgellm/kernels/cpu_native.py): the decode attention against the torch reference on
fresh random caches (GQA, scattered block tables, lengths on and off block edges, sliding windows,
a mixed decode + prefill step), and the fused decode pass (models/fused_decode.py) against the
layer-by-layer path on tiny models of several architectures and on the default model."""

from __future__ import annotations

import logging
import shutil
import threading

import pytest
import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref
from edgellm.models.fused_decode import (
    LINEAR_DENSE,
    LINEAR_INT_DOT,
    LINEAR_INT_N16,
    LINEAR_META,
    LINEAR_TINYGEMM,
    META_PER_LAYER,
)
from tests.helpers.isa_levels import vector_native
from tests.helpers.fused_paths import check_fused_against_layers, decode_both_ways, logprob_gap
from tests.helpers.quant_tiny import quantize_checkpoint


@pytest.fixture(scope="module")
def built():
    module = cpu_native.load()
    assert module is not None, "the C++ decode attention did not build (g++ and torch headers needed)"
    return module


def _decode_checked(cache, tables, lens, hq, window, g):
    """Random queries for one decode step over `cache`: the C++ result, checked against the torch
    reference. Returns (queries, result)."""
    b, hkv, d = len(lens), cache.shape[3], cache.shape[4]
    q = torch.randn(b, hq, d, generator=g)
    want = paged_attention_ref(q, q[:, :hkv], q[:, :hkv], cache, tables, lens, list(range(b + 1)), b,
                               d ** -0.5, window)
    got = cpu_native.load().decode_attention(q, cache, tables.long(), torch.tensor(lens), d ** -0.5, window or 0)
    assert (got - want).abs().max().item() < 1e-5
    return q, got


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (4, 4, 32, None), (6, 2, 48, 13), (8, 1, 16, 40)])
def test_decode_matches_the_reference(built, hq, hkv, d, window):
    g = torch.Generator().manual_seed(hq * 100 + d)
    nb, bs = 37, 16
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    lens = [1, 15, 16, 17, 63, 100, 5]
    b = len(lens)
    tables = torch.stack([torch.randperm(nb, generator=g)[:8] for _ in range(b)]).to(torch.int32)
    q, got = _decode_checked(cache, tables, lens, hq, window, g)
    scale = q.shape[-1] ** -0.5
    # through the CPU attention backend, sharing a step cache like the layers of a step do
    step: dict = {}
    for _ in range(2):
        via = CpuAttention(built).paged(q, q[:, :hkv], q[:, :hkv], cache, tables, lens, list(range(b + 1)), b,
                                        scale, window, step_cache=step)
        assert torch.equal(via, got)


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(9, 3, 64, 16, None), (4, 2, 32, 8, None), (14, 2, 64, 16, 50),
                                                 (8, 8, 96, 4, None)])
def test_decode_over_a_shared_cached_prefix(built, hq, hkv, d, bs, window):
    """Sequences whose leading pages are the same cached blocks (a system prompt) read each shared
    tile once for all of them: two such groups of different prefix lengths, a sequence that shares
    only a first block (under the 64-token minimum) and one that shares nothing, on fresh random
    caches against the torch reference."""
    g = torch.Generator().manual_seed(hq * 10 + bs)
    nb = 400
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    ids = torch.randperm(nb, generator=g).tolist()
    prefix_a, prefix_b = ids[:160 // bs], ids[160 // bs: 160 // bs + 96 // bs]  # 160 and 96 tokens
    rest = iter(ids[160 // bs + 96 // bs:])
    heads = [prefix_a] * 5 + [prefix_b] * 3 + [prefix_a[:1], []]
    own = [1, 3, 2, 5, 1, 2, 4, 1, 6, 7]  # own blocks per sequence
    tables, lens = [], []
    for i, (head, n) in enumerate(zip(heads, own)):
        blocks = head + [next(rest) for _ in range(n)]
        tables.append(blocks)
        lens.append(len(head) * bs + (n - 1) * bs + 1 + (i * 7) % bs)
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q, got = _decode_checked(cache, tables, lens, hq, window, g)
    scale = d ** -0.5
    # each sequence's result does not depend on who shares its prefix: alone, it is the same
    for i in (0, 6, 9):
        alone = built.decode_attention(q[i:i + 1], cache, tables[i:i + 1].long(), torch.tensor(lens[i:i + 1]),
                                       scale, window or 0)
        assert torch.equal(alone, got[i:i + 1])


def test_mixed_step_prefill_rows_stay_on_the_reference(built):
    g = torch.Generator().manual_seed(5)
    nb, bs, hq, hkv, d = 20, 16, 6, 2, 32
    cache = torch.zeros(2, nb, bs, hkv, d)
    # two decodes (contexts 30 and 7) and a 9-token prefill chunk over 12 cached tokens
    lens, qlens = [30, 7, 21], [1, 1, 9]
    tables = torch.tensor([[3, 9, 0], [4, 0, 0], [11, 12, 0]], dtype=torch.int32)
    for i, n in enumerate(lens):
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(n)])
        write_kv_ref(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), cache, slots)
    starts = [0, 1, 2, 11]
    q = torch.randn(sum(qlens), hq, d, generator=g)
    k = torch.randn(sum(qlens), hkv, d, generator=g)  # already in the cache for the reference's purposes
    want = paged_attention_ref(q, k, k, cache, tables, lens, starts, 2, d ** -0.5)
    got = CpuAttention(built).paged(q, k, k, cache, tables, lens, starts, 2, d ** -0.5)
    assert (got[:2] - want[:2]).abs().max().item() < 1e-5
    assert torch.equal(got[2:], want[2:])


def test_bad_tables_are_refused(built):
    cache = torch.randn(2, 4, 16, 2, 32)
    q = torch.randn(1, 2, 32)
    with pytest.raises(RuntimeError, match="block id out of the cache"):
        built.decode_attention(q, cache, torch.tensor([[7]]), torch.tensor([5]), 0.1, 0)
    with pytest.raises(RuntimeError, match="sequence length out of its block table"):
        built.decode_attention(q, cache, torch.tensor([[1]]), torch.tensor([17]), 0.1, 0)


def test_fast_engine_decodes_through_it(built, monkeypatch):
    from edgellm import LLM, SamplingParams

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="fast", enable_prefix_caching=False)
    layers = llm.engine.model.attention_layers()
    backend = layers[0].backend
    assert isinstance(backend, CpuAttention) and backend.native is not None
    assert all(a.backend is backend for a in layers)  # one backend, chosen once for the load
    llm.engine.model.model.fused = None  # decode steps layer by layer: the attention kernel alone
    calls = []

    class Counting:  # the module, with its decode attention counted
        def __getattr__(self, name):
            return getattr(built, name)

        def decode_attention(self, *args):
            calls.append(args[0].shape[0])
            return built.decode_attention(*args)

    monkeypatch.setattr(backend, "native", Counting())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "Name three colours."}]]
    got = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    assert calls and max(calls) == 2
    monkeypatch.setattr(backend, "native", None)  # decode rows through the torch reference
    want = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    assert got == want


def _broken_sources(tmp_path):
    """A copy of edgellm/kernels/csrc/cpu whose only .cpp is rotary.cpp with an undeclared name in
    it (a build that fails in seconds), and the "file:line:" its error names."""
    src = tmp_path / "csrc"
    shutil.copytree(cpu_native.CSRC, src)
    for path in src.glob("*.cpp"):
        if path.name != "rotary.cpp":
            path.unlink()
    lines = (src / "rotary.cpp").read_text().splitlines()
    at = next(i for i, text in enumerate(lines) if text.startswith("namespace")) + 1
    lines.insert(at, "int broken = undeclared_name;")
    (src / "rotary.cpp").write_text("\n".join(lines) + "\n")
    return src, f"rotary.cpp:{at + 1}:"


def test_a_compile_error_is_reported_with_its_file_and_line(tmp_path, monkeypatch, caplog):
    """A copy of edgellm/kernels/csrc/cpu with one broken .cpp (the only .cpp left, so the build fails in
    seconds): the build returns the compiler's first error with its file and line, and the loader
    falls back to None with that in its one warning."""
    src, where = _broken_sources(tmp_path)
    module, why = cpu_native._build(src, cache_dir=tmp_path / "cache" / "torch_extensions")
    assert module is None
    assert where in why and "error" in why and "undeclared_name" in why, why

    monkeypatch.setattr(cpu_native, "CSRC", src)
    monkeypatch.setattr(cpu_native, "_modules", {})
    monkeypatch.setattr(cpu_native, "_failed", set())
    # another build directory: torch skips the build of a name it already tried in this process
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "loader_cache"))
    monkeypatch.delenv(cpu_native.ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=cpu_native.logger.name):
        assert cpu_native.load() is None
        assert cpu_native.load() is None  # failed once: not rebuilt, not warned again
    warned = [r.getMessage() for r in caplog.records if r.name == cpu_native.logger.name]
    assert len(warned) == 1 and where in warned[0] and "using the torch paths" in warned[0], warned


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(tmp_path):
    """torch's build lock is a plain file that its waiters poll forever when the build that wrote
    it was killed: with one left in the build directory, the next build still runs (and reports
    its compiler error) instead of hanging."""
    src, where = _broken_sources(tmp_path)
    cache = tmp_path / "cache"
    build = cache / f"edgellm_cpu_native_{cpu_native._source_key(src, ['-O3', *cpu_native.OPENMP])}"
    build.mkdir(parents=True)
    (build / "lock").touch()
    result = []
    worker = threading.Thread(target=lambda: result.append(cpu_native._build(src, cache_dir=cache)), daemon=True)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "the build waited on the stale lock"
    module, why = result[0]
    assert module is None and where in why, why


def test_disabled_build_falls_back_to_the_reference(built, monkeypatch):
    monkeypatch.setattr(cpu_native, "_modules", {})
    monkeypatch.setattr(cpu_native, "_failed", set())
    monkeypatch.setenv(cpu_native.ENV, "torch")
    assert cpu_native.load() is None
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 6, 16, 2, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    tables = torch.tensor([[1, 2], [5, 0]], dtype=torch.int32)
    args = (q, q[:, :2], q[:, :2], cache, tables, [20, 9], [0, 1, 2], 2, 0.2)
    assert torch.equal(CpuAttention(cpu_native.load()).paged(*args), paged_attention_ref(*args))


PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}],
           [{"role": "user", "content": "Write a haiku about the sea."}],
           [{"role": "user", "content": "Explain gravity to a child in two sentences."}]]


def _linear_kinds(fused) -> set[int]:
    """The kinds of every linear in a fused pass's meta (models/fused_decode.py layout)."""
    per_layer = META_PER_LAYER
    return {fused.meta[start + j * LINEAR_META] for start in range(0, len(fused.meta), per_layer) for j in range(4)}


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral", "qwen2", "phi3", "exaone", "llama32",
                                  "qwen3", "gemma3", "gemma3_6", "exaone4"])
def test_fused_decode_matches_the_layer_path(built, tiny_dir, arch):
    """fp32 weights: the same math as the layers up to summation order (qkv biases, sliding
    window, longrope, GQA 4:1 and 4:2; q/k norms, sandwich and post norms, GeGLU, Gemma 3's local
    rotary table, EXAONE 4's global layers without rotary)."""
    from edgellm import LLM

    path, _ = tiny_dir(arch)
    llm = LLM(str(path), kv_cache_memory=1 << 20, cpu_quant="fast", enable_prefix_caching=False)
    g = torch.Generator().manual_seed(len(arch))
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 19, 33)]
    got, want, ran = decode_both_ways(llm, prompts, 30)  # past mistral's 24-token window
    assert any(ran) and not all(ran)  # decode steps fused; prefill steps not
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert logprob_gap(got, want) < 1e-4


@pytest.mark.parametrize("arch", ["phi4mini"])
def test_fused_decode_is_not_built_for_partial_rotary(built, tiny_dir, arch):
    """Partial rotary is not in the fused C++ pass: such models decode layer by layer (still token
    for token transformers', tests/models/test_architectures.py), in every CPU mode."""
    from edgellm import LLM

    path, _ = tiny_dir(arch)
    for mode in ("exact", "fast"):
        assert LLM(str(path), kv_cache_memory=1 << 20, cpu_quant=mode).engine.model.model.fused is None


def test_fused_decode_on_the_default_model(built):
    """int4 GEMV + bf16 activations: bf16 rounding can flip differently than in the layer path
    (the inputs differ in the last fp32 bit), so logprobs agree to bf16 noise, and tokens until a
    position where the layer path's own top two are nearly tied."""
    from edgellm import LLM
    from edgellm.quant.linear_kernels.cpu_fast import CpuInt4Kernel

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="fast", enable_prefix_caching=False)
    fused = llm.engine.model.model.fused
    assert fused is not None and _linear_kinds(fused) == {LINEAR_TINYGEMM}  # int4 GEMV everywhere
    assert all(isinstance(m.kernel, CpuInt4Kernel) for m in llm.engine.model.modules() if hasattr(m, "kernel"))
    got, want, ran = decode_both_ways(llm, PROMPTS, 20)
    assert sum(ran) >= 19
    gaps = []
    for g, w in zip(got, want):
        gt, wt = g.outputs[0].token_ids, w.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(gt, wt)) if a != b), len(wt))
        if first < len(wt):  # only where the layer path itself is nearly tied (0.068 nats measured)
            top = w.outputs[0].logprobs[first][1]
            # int8 activations per 32 columns move logits by more than bf16 does (a block's small
            # entries round on its largest one's scale; benchmarks/cpu_quant_accuracy.py: top-1
            # agrees with exact at 96% of teacher-forced positions), so a divergence must sit
            # where the exact model's top two are within 0.5 nats
            assert top[0][1] - top[1][1] < 0.5, (first, top)
        gaps += [abs(a[0] - b[0]) for a, b in zip(g.outputs[0].logprobs[:first], w.outputs[0].logprobs[:first])]
    # within bf16 noise; zero is fine too (a CPU whose bf16 rounding happens to agree)
    assert gaps and max(gaps) < 0.2


def test_fused_decode_is_exact_math_on_fp32_weights(built):
    """The default model dequantized to fp32 (the exact path's weights) through the fused pass:
    it must agree with the layers to fp32 summation noise."""
    from edgellm import LLM
    from edgellm.models.fused_decode import FusedDecode

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="exact", enable_prefix_caching=False)
    model = llm.engine.model.model
    assert model.fused is not None and _linear_kinds(model.fused) == {LINEAR_DENSE}
    model.fused = FusedDecode.build(model, model.fused.native)  # a fresh one: built from the loaded model alone
    got, want, ran = decode_both_ways(llm, PROMPTS, 20)
    assert sum(ran) >= 19
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert logprob_gap(got, want) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_decode_with_an_fp8_cache(built, tiny_dir, arch):
    """fp8 KV: the fused pass writes e4m3 codes as the layer path does (x / scale clamped to +-448,
    rounded to nearest even) and decodes them exactly. The two paths' K/V differ by fp32 summation
    noise before rounding, and with 3 mantissa bits a value that close to a rounding boundary lands
    on the neighbouring code: measured gaps 1e-5 to 1.4e-4, where a wrong rounding mode or decode
    moves logprobs by 1e-2 and more."""
    path, _ = tiny_dir(arch)
    check_fused_against_layers(path, "fp8", torch.float8_e4m3fn, 3, (6, 21), 24, 1e-3)


def test_fused_decode_is_not_built_for_act_order_int4(built, tiny_dir, tmp_path):
    from edgellm import LLM

    src, hf = tiny_dir("llama")
    dst, _ = quantize_checkpoint(src, hf, tmp_path / "ckpt", "gptq", desc_act=True, shard_g_idx=True)
    llm = LLM(str(dst), kv_cache_memory=1 << 20, cpu_quant="fast")
    assert llm.engine.model.model.fused is None


def test_fused_decode_runs_int4_with_biases_and_float_layers(built, tiny_dir, tmp_path):
    """Qwen2 GPTQ with o_proj left in fp32: int4 GEMV, qkv biases and a float matrix in one pass."""
    from edgellm import LLM

    src, hf = tiny_dir("qwen2")
    dst, _ = quantize_checkpoint(src, hf, tmp_path / "ckpt", "gptq", ignore=("o_proj",))
    llm = LLM(str(dst), kv_cache_memory=1 << 20, cpu_quant="fast", enable_prefix_caching=False)
    fused = llm.engine.model.model.fused
    assert fused is not None
    assert fused.meta[0] == LINEAR_TINYGEMM and fused.meta[LINEAR_META] == LINEAR_DENSE  # qkv int4, o_proj fp32
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 11)]
    got, want, ran = decode_both_ways(llm, prompts, 16)
    assert any(ran)
    assert logprob_gap(got, want) < 0.05


def test_bf16_prefill_attention_is_close_to_fp32():
    """The fast mode's prefill attention in bf16 (prefill_dtype), over a cached prefix and from
    scratch, against the fp32 reference: close at bf16 precision, not equal."""
    g = torch.Generator().manual_seed(9)
    nb, bs, hq, hkv, d = 12, 16, 6, 2, 32
    cache = torch.zeros(2, nb, bs, hkv, d)
    tables = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 0]], dtype=torch.int32)
    lens, qlens = [50, 21], [14, 21]  # 36 cached tokens + 14 new; a fresh 21-token prompt
    for i, n in enumerate(lens):
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(n)])
        write_kv_ref(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), cache, slots)
    q = torch.randn(sum(qlens), hq, d, generator=g)
    # this step's keys/values: only the fresh prompt's are read directly (slots 80..100); the
    # first sequence's context, cached prefix included, is read from the pages
    flat = cache.view(2, -1, hkv, d)
    k = torch.cat([flat[0, 36:50], flat[0, 80:101]])
    v = torch.cat([flat[1, 36:50], flat[1, 80:101]])
    args = (q, k, v, cache, tables, lens, [0, 14, 35], 0, d ** -0.5)
    want = paged_attention_ref(*args)
    got = CpuAttention(None, torch.bfloat16).paged(*args)
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert 0 < err < 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("native", [False, True])
def test_shared_prefix_cascade_prefill(native):
    """Prefill chunks sharing cached prefix pages: one product against the prefix, one per chunk
    against its own suffix (torch's flash, or the C++ causal kernel over the pages), merged by
    log-sum-exp. In fp32 it must equal the per-sequence reference; chunks that do not share
    enough fall back to the per-sequence path (the C++ kernel per chunk, or torch's SDPA)."""
    import edgellm.attention.cpu_cascade as cpu_cascade

    mod = vector_native() if native else None

    g = torch.Generator().manual_seed(4)
    nb, bs, hq, hkv, d = 40, 16, 9, 3, 64
    cache = torch.zeros(2, nb, bs, hkv, d)
    flat = cache.view(2, -1, hkv, d)
    flat.copy_(torch.randn(flat.shape, generator=g))
    shared = list(range(8))  # a 128-token cached prefix in blocks 0..7
    owns = [[8, 9, 10], [11, 12], [13, 14, 15]]
    lens = [150, 140, 170]  # 20, 7 and 40 new tokens (starts below)
    tables = torch.tensor([shared + own + [0] * (12 - 8 - len(own)) for own in owns], dtype=torch.int32)
    starts = [0, 20, 27, 67]
    q = torch.randn(67, hq, d, generator=g)
    k = torch.randn(67, hkv, d, generator=g)  # unused: every chunk reads its context from the pages
    want = paged_attention_ref(q, k, k, cache, tables, lens, starts, 0, d ** -0.5)
    step: dict = {}
    got = CpuAttention(mod, torch.float32, causal_kernel=native).paged(q, k, k, cache, tables, lens, starts, 0,
                                                                        d ** -0.5, step_cache=step)
    assert step[("cascade", 0)] == 8
    assert (got - want).abs().max().item() < 1e-5
    fast = CpuAttention(None, torch.bfloat16).paged(q, k, k, cache, tables, lens, starts, 0, d ** -0.5,
                                                    step_cache={})
    assert 0 < (fast - want).abs().max().item() < 2e-2 * want.abs().max().item()
    # a chunk with its own first block: nothing shared, the per-sequence path
    other = tables.clone()
    other[1, 0] = 30
    flat[:, 30 * bs:31 * bs] = flat[:, :bs]
    step = {}
    alone = CpuAttention(mod, torch.float32, causal_kernel=native).paged(q, k, k, cache, other, lens, starts, 0,
                                                                         d ** -0.5, step_cache=step)
    assert step[("cascade", 0)] == 0
    assert (alone - paged_attention_ref(q, k, k, cache, other, lens, starts, 0, d ** -0.5)).abs().max() < 1e-5
    # below CASCADE_MIN_PREFIX tokens of shared prefix: not worth it
    assert cpu_cascade._shared_prefix_blocks(tables[:, :3], [40, 40, 40], [0, 4, 8, 12], 0, bs) == 0


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("qlens,hq,hkv", [([25, 9], 4, 2), ([13, 13, 13], 9, 3)])
def test_cascade_when_the_suffix_is_this_steps_tokens(qlens, hq, hkv, native):
    """The usual voice case: every chunk's cached part is exactly the shared prefix, so its suffix
    is this step's own keys and values (torch: read from the arguments, all chunks in one causal
    call, padded to the longest when their lengths differ; C++: from each chunk's pages)."""
    mod = vector_native() if native else None
    g = torch.Generator().manual_seed(6)
    nb, bs, d = 30, 16, 64
    cache = torch.zeros(2, nb, bs, hkv, d)
    flat = cache.view(2, -1, hkv, d)
    flat[:, : 6 * bs] = torch.randn(2, 6 * bs, hkv, d, generator=g)  # 96 shared tokens, blocks 0..5
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 10, 11], [0, 1, 2, 3, 4, 5, 20, 0], [0, 1, 2, 3, 4, 5, 22, 0]],
                          dtype=torch.int32)[: len(qlens)]
    lens = [96 + n for n in qlens]
    keys, values = [], []
    for i, n in enumerate(qlens):
        kk, vv = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(96, 96 + n)])
        write_kv_ref(kk, vv, cache, slots)
        keys.append(kk)
        values.append(vv)
    k, v = torch.cat(keys), torch.cat(values)
    q = torch.randn(sum(qlens), hq, d, generator=g)
    starts = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
    args = (q, k, v, cache, tables, lens, starts, 0, d ** -0.5)
    want = paged_attention_ref(*args)
    step: dict = {}
    got = CpuAttention(mod, torch.float32, causal_kernel=native).paged(*args, step_cache=step)
    assert step[("cascade", 0)] == 6
    assert (got - want).abs().max().item() < 1e-5


def test_cascade_inside_the_engine_matches_the_per_sequence_path(built):
    """Three requests over one cached system prompt, admitted in the same step: with fp32
    "prefill_dtype" the cascade runs in the engine and must give the per-sequence path's logprobs."""
    import edgellm.attention.cpu as cpu_attention
    from edgellm import LLM, SamplingParams

    llm = LLM(kv_cache_memory=32 << 20, max_model_len=512, cpu_quant="exact")
    system = "You are a helpful voice assistant for a travel agency. " * 12
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": u}]
             for u in ("Book a flight to Rome.", "What is the weather in Oslo?", "Cancel my hotel.")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    llm.chat(chats[:1], SamplingParams(max_tokens=1))  # the system prompt is now cached
    want = llm.chat(chats, params)
    llm.chat(chats[:1], SamplingParams(max_tokens=1))
    calls = []
    original = cpu_attention.cascade_prefill

    def counted(*args):
        done = original(*args)
        calls.append(done > args[7])
        return done

    layers = llm.engine.model.attention_layers()
    exact = layers[0].backend
    assert exact.prefill_dtype is None  # mode exact: chunks one at a time, in fp32
    cpu_attention.cascade_prefill = counted
    try:
        for attn in layers:
            attn.backend = CpuAttention(exact.native, torch.float32)
        got = llm.chat(chats, params)
    finally:
        cpu_attention.cascade_prefill = original
        for attn in layers:
            attn.backend = exact
    assert any(calls)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert logprob_gap(got, want) < 1e-4


@pytest.mark.parametrize("rows,width", [(1, 576), (3, 37), (130, 96), (517, 1536)])
def test_silu_mul_rounds_once_to_bf16(built, rows, width):
    """silu(gate) * up from bf16 or fp32 [T, 2I]: within one bf16 rounding of the fp32 value (and
    on bf16 input, exactly the fp32 value rounded once)."""
    g = torch.Generator().manual_seed(rows + width)
    gu = torch.randn(rows, 2 * width, generator=g) * 4
    for x in (gu, gu.bfloat16()):
        got = built.silu_mul(x)
        gate, up = x.float().split(width, -1)
        want = torch.nn.functional.silu(gate) * up
        assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-30).all()
        if x.dtype == torch.bfloat16:
            # exp within 2 ulp: the rounded result may differ from the exactly rounded one by one bf16 ulp
            ulps = (got.float() - want.bfloat16().float()).abs() / want.abs().clamp_min(1e-30)
            assert (ulps <= 2.0 ** -7).all()
    # a strided view of the rows (the projection's output sliced by rows) works as well
    assert torch.equal(built.silu_mul(gu[::2]), built.silu_mul(gu[::2].contiguous()))


@pytest.mark.parametrize("rows,width", [(1, 576), (3, 37), (130, 96), (517, 1536)])
def test_silu_mul_f32_matches_torch(built, rows, width):
    """silu(gate) * up from fp32 [T, 2I] into fp32 in one pass: within a few fp32 ulps of torch's
    silu and mul (exp is within 2 ulp of expf); strided rows read like contiguous ones."""
    g = torch.Generator().manual_seed(7 * rows + width)
    gu = torch.randn(rows, 2 * width, generator=g) * 6
    got = built.silu_mul_f32(gu)
    gate, up = gu.double().split(width, -1)
    want = torch.nn.functional.silu(gate) * up
    assert got.dtype == torch.float32 and got.shape == (rows, width)
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -20 + 1e-35).all()
    assert torch.equal(built.silu_mul_f32(gu[::2]), built.silu_mul_f32(gu[::2].contiguous()))


def test_fast_mode_norms_and_mlp_use_the_cpp_kernels(built):
    """The load's ops give the fast path's prefill norms and SiLU-and-mul the C++ kernels (and only there)."""
    from edgellm import LLM

    fast = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="fast")
    exact = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="exact")
    for llm, on in ((fast, True), (exact, False)):
        model = llm.engine.model.model
        assert (model.norm.native is not None) is on
        assert all((layer.input_layernorm.native is not None) is on and (layer.mlp.native_silu_mul is not None) is on
                   and (layer.mlp.native_act is not None) is on for layer in model.layers)


def test_auto_mode_on_the_default_model(built):
    """cpu_quant auto: int4 linears by integer dots (also inside the fused decode) and the
    integer-dot logits head; greedy text equals the exact path's except where the exact model's
    own top two are nearly tied, and logprobs stay close."""
    from edgellm import LLM
    from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel
    from edgellm.quant.linear_kernels.cpu_int_head import IntDotLogitsHead

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="auto", enable_prefix_caching=False)
    model = llm.engine.model
    kernels = [m.kernel for m in model.modules() if hasattr(m, "kernel")]
    assert kernels and all(isinstance(k, CpuIntDotKernel) for k in kernels)
    assert isinstance(model.fast_logits, IntDotLogitsHead)
    assert model.model.fused is not None and _linear_kinds(model.model.fused) == {LINEAR_INT_N16 if select().n16 else LINEAR_INT_DOT}
    for k in kernels:  # integer dots in prompts too (calibration may give large steps the dense matmul)
        k.max_rows = 1 << 62
    exact = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="exact", enable_prefix_caching=False)
    from edgellm import SamplingParams

    # no logprobs asked of auto: its rows are argmax-only, so the integer-dot head serves them
    got = llm.chat(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    want = exact.chat(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2))
    for g, w in zip(got, want):
        gt, wt = g.outputs[0].token_ids, w.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(gt, wt)) if a != b), len(wt))
        if first < len(wt):
            top = w.outputs[0].logprobs[first][1]
            # int8 activations per 32 columns move logits by more than bf16 does (a block's small
            # entries round on its largest one's scale; benchmarks/cpu_quant_accuracy.py: top-1
            # agrees with exact at 96% of teacher-forced positions), so a divergence must sit
            # where the exact model's top two are within 0.5 nats
            assert top[0][1] - top[1][1] < 0.5, (first, top)


def test_auto_mlp_keeps_a_bf16_intermediate_only_where_both_linears_run_bf16(built):
    """Mode auto on a CPU with bf16 units: a step whose MLP linears both run their bf16 dense
    copies keeps gate/up and SiLU-and-mul in bf16 (those matmuls round to bf16 anyway); the
    result is the fp32-intermediate path's up to that one rounding of the intermediate. Steps
    of integer-dot size, and every step on CPUs without bf16 units, keep fp32."""
    from edgellm import LLM

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="auto", enable_prefix_caching=False)
    mlp = llm.engine.model.model.layers[0].mlp
    bf16_units = select().bf16_units
    assert mlp.bf16_intermediate == bf16_units
    small = mlp.gate_up_proj.kernel.max_rows
    assert not mlp._bf16_step(1) and not mlp._bf16_step(min(small, 1 << 20))
    if not bf16_units:
        return
    rows = small + 7 if mlp.gate_up_proj.kernel.dense is not None else None
    if rows is None:  # calibration dropped the dense copies: no step runs bf16
        assert not mlp._bf16_step(1 << 20)
        return
    assert mlp._bf16_step(rows)
    x = torch.randn(rows, mlp.gate_up_proj.kernel.k, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = mlp(x)
        mlp.bf16_intermediate = False
        want = mlp(x)
        mlp.bf16_intermediate = True
        gate, up = mlp.gate_up_proj(x).split(mlp.intermediate_size, dim=-1)
        h = torch.nn.functional.silu(gate) * up
    w = mlp.down_proj.kernel.dense_matmul(torch.eye(h.shape[1]), None).float().t()  # [H, I] as used
    bound = (h.abs() * 2.0**-8) @ w.abs().t() + 2.0**-7 * want.abs()  # + the outputs' bf16 rounding
    assert got.dtype == torch.float32 and ((got - want).abs() <= bound).all()
