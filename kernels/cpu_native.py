"""C++ kernels for fp32 models on CPU (both --cpu-quant modes): decode attention over the
paged KV cache, and a fused decode pass over all decoder layers.

decode_attention: the torch reference (paged_attention.paged_attention_ref)
gathers every sequence's blocks into a contiguous copy and runs SDPA with an
additive mask: three passes over the context and ~10 torch ops per layer. This
kernel reads K and V straight from the pages, once each, with one program per
(sequence, kv head) spread over torch's intra-op threads (at::parallel_for):
the G query heads sharing that kv head (GQA) score every position, softmax in
fp32, then accumulate V; dot products and updates in AVX-512 where the CPU has
it (the build is for the host ISA), scalar loops otherwise. Same cache layout as
everywhere: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], fp32.

decode_layers: a decode-only step (one token per sequence) through every
decoder layer in one call: RMSNorm, the qkv / o / gate_up / down matmuls
(torch's int4 GEMV with bf16 activations up to `int4_max_rows` rows, else the
layer's bf16 or fp32 dense matrix; the same ATen ops the Python path calls),
rotary (neox halves), the K/V write, the attention above, SiLU-and-mul and
both residual adds. What it removes is the per-op Python and dispatcher cost
of ~40 small ops per layer, which at batch 1 on SmolLM2-135M was half of a
decode step. The Python model (models/decoder.FusedDecode) decides when it
applies and falls back to the layer-by-layer path otherwise.

The module is compiled on first use with torch.utils.cpp_extension (g++,
ninja and torch's headers; ~30 s once, cached under
$EDGELLM_CACHE/torch_extensions, keyed by the source and this CPU's flags
since it is built for the host ISA). When the build fails or is disabled
(EDGELLM_CPU_NATIVE=torch) the torch paths run instead, with one warning.
fp32 math, summed in another order than the torch ops (and FMA-contracted):
results agree with them to ~1e-6 relative (tests/test_cpu_native.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "EDGELLM_CPU_NATIVE"  # "cpp" (default) or "torch"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float* y, float p, const float* x, int64_t n) {  // y += p * x
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(y + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
#endif
  for (; d < n; ++d) y[d] += p * x[d];
}

// Decode attention for B sequences, one query token each. q row b at q + b * q_stride (Hq heads of
// D), output row b at out + b * out_stride. K/V pages: kc / vc [NB, BS, Hkv, D]. block tables
// [B, MB] int64, seq_lens [B] (context incl. this token), window <= 0: none.
static void attend(const float* q, int64_t q_stride, float* out, int64_t out_stride, const float* kc,
                   const float* vc, int64_t BS, int64_t Hkv, int64_t D, int64_t G, const int64_t* bt,
                   int64_t MB, const int64_t* sl, int64_t B, float sc, int64_t window) {
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t len = sl[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      scores.resize(G * n);
      const float* qb = q + b * q_stride + h * G * D;
      for (int64_t t = lo; t < len; ++t) {
        const float* k = kc + ((bt[b * MB + t / BS] * BS + t % BS) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * n + (t - lo)] = dot(qb + g * D, k, D) * sc;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = lo; t < len; ++t) {
        const float* v = vc + ((bt[b * MB + t / BS] * BS + t % BS) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, scores[g * n + (t - lo)], v, D);
      }
      std::copy(acc.begin(), acc.end(), out + b * out_stride + h * G * D);
    }
  });
}

static void check_tables(const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t B,
                         int64_t NB, int64_t BS) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(),
              "block_tables: [B, MB] int64");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  TORCH_CHECK(block_tables.size(0) >= B && seq_lens.size(0) >= B, "one row per sequence");
  const int64_t MB = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= MB * BS, "sequence length out of its block table");
    for (int64_t j = 0; j < (sl[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < NB, "block id out of the cache");
  }
}

static void check_cache(const torch::Tensor& kv_cache, int64_t D) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.scalar_type() == torch::kFloat && kv_cache.is_contiguous(),
              "kv_cache: [2, NB, BS, Hkv, D] fp32 contiguous");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == D, "kv_cache head_dim");
}

// q [B, Hq, D] fp32; kv_cache [2, NB, BS, Hkv, D] fp32; block_tables [B, MB] int64;
// seq_lens [B] int64 (context length, this step's token included); window <= 0: none.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [B, Hq, D] fp32");
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  check_cache(kv_cache, D);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  check_tables(block_tables, seq_lens, B, NB, BS);
  auto out = torch::empty_like(q);
  const float* kc = kv_cache.data_ptr<float>();
  attend(q.data_ptr<float>(), Hq * D, out.data_ptr<float>(), Hq * D, kc, kc + NB * BS * Hkv * D, BS, Hkv, D,
         Hq / Hkv, block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B,
         static_cast<float>(scale), window);
  return out;
}

// y = x W^T (+ bias) for one linear: int4 GEMV (bf16 activations) up to max_rows rows when packed
// is given, else the dense matrix in its own dtype (bf16 or fp32). Empty tensors mean "absent".
static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                            int64_t group, const torch::Tensor& dense, const torch::Tensor& bias, int64_t max_rows) {
  torch::Tensor y;
  if (packed.numel() > 0 && x.size(0) <= max_rows) {
    y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), packed, group, sz).to(at::kFloat);
  } else if (dense.scalar_type() == at::kBFloat16) {
    y = at::linear(x.to(at::kBFloat16), dense).to(at::kFloat);
  } else {
    y = at::linear(x, dense);
  }
  if (bias.numel() > 0) y.add_(bias);
  return y;
}

static void rmsnorm(const float* x, const float* w, float* out, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = x[i] * r * w[i];
}

// Rotary (neox halves) in place on the first `heads` heads of each row of x [T, W] fp32 (row
// stride W, e.g. a qkv projection: q heads, then k heads, then v). cos/sin [T, D] fp32.
static void rotate_rows(float* x, int64_t stride, const float* cp, const float* snp, int64_t T, int64_t heads,
                        int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* v = x + t * stride + hh * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

torch::Tensor rotate_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x: [T, W] fp32, rows contiguous");
  TORCH_CHECK(heads * head_dim <= x.size(1) && head_dim % 2 == 0, "heads * head_dim within a row");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == x.size(0) * head_dim && sin.numel() == x.size(0) * head_dim,
              "cos/sin: [T, head_dim] fp32 contiguous");
  pybind11::gil_scoped_release no_gil;
  rotate_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads,
              head_dim);
  return x;
}

constexpr int64_t PER_LAYER = 19;  // tensors per layer, see decode_layers

// One decode-only step through all layers. x [B, H] fp32 (embeddings in, hidden states out, updated
// in place); cos/sin [B, D] fp32 (neox halves); slots [B] int64 (where each token's K/V go);
// block_tables [B, MB] int64; seq_lens [B] int64. Per layer, PER_LAYER tensors in `w`:
//   input norm weight; qkv (packed, scale_zero, dense, bias); o (4); post norm weight;
//   gate_up (4); down (4); the layer's kv cache
// with `meta` per layer: 4 int4 group sizes (qkv, o, gate_up, down) and the sliding window (<= 0: none).
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                            torch::Tensor block_tables, torch::Tensor seq_lens, std::vector<torch::Tensor> w,
                            std::vector<int64_t> meta, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t intermediate, double eps, double scale, int64_t int4_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [B, H] fp32");
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  TORCH_CHECK(w.size() % PER_LAYER == 0 && meta.size() == w.size() / PER_LAYER * 5, "per-layer tensors");
  const int64_t B = x.size(0), H = x.size(1), D = head_dim, Hq = num_heads, Hkv = num_kv_heads;
  const int64_t G = Hq / Hkv, QKV = (Hq + 2 * Hkv) * D, I = intermediate;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D, "cos/sin [B, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == B, "slots: [B] int64");
  const int64_t L = w.size() / PER_LAYER;
  if (B == 0 || L == 0) return x;
  check_cache(w[PER_LAYER - 1], D);
  const int64_t NB = w[PER_LAYER - 1].size(1), BS = w[PER_LAYER - 1].size(2);
  TORCH_CHECK(w[PER_LAYER - 1].size(3) == Hkv && Hq % Hkv == 0, "kv heads");
  check_tables(block_tables, seq_lens, B, NB, BS);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < NB * BS, "slot out of the cache");
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  auto h = torch::empty_like(x);
  auto attn = torch::empty({B, Hq * D}, x.options());
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* t = w.data() + l * PER_LAYER;
    const int64_t* m = meta.data() + l * 5;
    const torch::Tensor& cache = t[18];
    check_cache(cache, D);
    TORCH_CHECK(cache.size(1) == NB && cache.size(2) == BS && cache.size(3) == Hkv, "kv caches differ across layers");
    float* kc = cache.data_ptr<float>();
    float* vc = kc + NB * BS * Hkv * D;
    // attention block
    float* hp = h.data_ptr<float>();
    const float* n1 = t[0].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) rmsnorm(xp + b * H, n1, hp + b * H, H, static_cast<float>(eps));
    auto qkv = linear(h, t[1], t[2], m[0], t[3], t[4], int4_max_rows).contiguous();
    TORCH_CHECK(qkv.size(1) == QKV, "qkv width");
    float* qp = qkv.data_ptr<float>();
    rotate_rows(qp, QKV, cp, snp, B, Hq + Hkv, D);  // q heads, then k heads
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = sp[b];
      std::copy(qp + b * QKV + Hq * D, qp + b * QKV + (Hq + Hkv) * D, kc + slot * Hkv * D);
      std::copy(qp + b * QKV + (Hq + Hkv) * D, qp + (b + 1) * QKV, vc + slot * Hkv * D);
    }
    attend(qp, QKV, attn.data_ptr<float>(), Hq * D, kc, vc, BS, Hkv, D, G, block_tables.data_ptr<int64_t>(),
           block_tables.size(1), seq_lens.data_ptr<int64_t>(), B, static_cast<float>(scale), m[4]);
    auto o = linear(attn, t[5], t[6], m[1], t[7], t[8], int4_max_rows).contiguous();
    const float* op = o.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += op[i];
    // MLP block
    const float* n2 = t[9].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) rmsnorm(xp + b * H, n2, hp + b * H, H, static_cast<float>(eps));
    auto gu = linear(h, t[10], t[11], m[2], t[12], t[13], int4_max_rows);
    TORCH_CHECK(gu.size(1) == 2 * I, "gate_up width");
    auto act = at::silu(gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I));
    auto d = linear(act, t[14], t[15], m[3], t[16], t[17], int4_max_rows).contiguous();
    const float* dp = d.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += dp[i];
  }
  return x;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def load():
    """The compiled module, or None (build failed or disabled: the torch reference runs)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get(ENV, "cpp") == "torch":
            _failed = True
            return None
        key = hashlib.sha256((SOURCE + _cpu_flags() + torch.__version__).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("EDGELLM_CACHE", Path.home() / ".cache" / "edgellm")) / "torch_extensions"
        build = cache / f"edgellm_cpu_native_{key}"
        if shutil.which("ninja") is None:  # the pip package's binary, when its bin dir is not on PATH
            try:
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
        try:
            from torch.utils.cpp_extension import load_inline

            build.mkdir(parents=True, exist_ok=True)
            _module = load_inline(
                name=f"edgellm_cpu_native_{key}",
                cpp_sources=[SOURCE],
                functions=["decode_attention", "decode_layers", "rotate_"],
                extra_cflags=["-O3", "-march=native"],
                build_directory=str(build),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001  (no compiler, no headers: the torch paths still work)
            _failed = True
            logger.warning("C++ CPU kernels unavailable (%s: %s); using the torch paths",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return _module


def supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and query.dtype == torch.float32 and kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous())


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D] fp32, one token per sequence
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D] fp32
    block_tables: torch.Tensor,  # [>=B, MB] int64
    seq_lens: torch.Tensor,  # [>=B] int64
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    return module.decode_attention(query.contiguous(), kv_cache, block_tables, seq_lens, float(scale),
                                   int(sliding_window or 0))


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rotary (neox halves) in place on the first `heads` heads of each row of x [T, W] fp32 (a
    qkv projection: q heads, then k heads); cos/sin [T, head_dim]. One pass instead of torch's
    five (mul, neg, cat, mul, add over copies)."""
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    return module.rotate_(x, cos.contiguous(), sin.contiguous(), int(heads), int(head_dim))
