"""Decode attention over the paged KV cache in C++ for the CPU ("fast" mode).

The torch reference (paged_attention.paged_attention_ref) gathers every
sequence's blocks into a contiguous copy and runs SDPA with an additive mask:
three passes over the context and ~10 torch ops per layer. This kernel reads
K and V straight from the pages, once each, with one program per (sequence,
kv head) spread over torch's intra-op threads (at::parallel_for): the G query
heads sharing that kv head (GQA) score every position, softmax in fp32, then
accumulate V; dot products and updates in AVX-512 where the CPU has it (the
build is for the host ISA), scalar loops otherwise. Same cache layout as everywhere:
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], fp32.

It is compiled on first use with torch.utils.cpp_extension (g++ and torch's
headers; ~30 s once, cached under $EDGELLM_CACHE/torch_extensions, keyed by
the source and this CPU's flags since it is built for the host ISA). When the
build fails or is disabled (EDGELLM_CPU_ATTENTION=torch) the reference runs
instead, with one warning. fp32 math, summed in another order than SDPA: the
results agree to ~1e-6 (tests/test_cpu_attention.py).
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

ENV = "EDGELLM_CPU_ATTENTION"  # "cpp" (default) or "torch"

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

// q [B, Hq, D] fp32; kv_cache [2, NB, BS, Hkv, D] fp32; block_tables [B, MB] int64;
// seq_lens [B] int64 (context length, this step's token included); window <= 0: none.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [B, Hq, D] fp32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.scalar_type() == torch::kFloat && kv_cache.is_contiguous(),
              "kv_cache: [2, NB, BS, Hkv, D] fp32 contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes");
  TORCH_CHECK(block_tables.size(0) >= B && seq_lens.size(0) >= B, "one row per sequence");
  const int64_t G = Hq / Hkv, MB = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kc = kv_cache.data_ptr<float>();
  const float* vc = kc + NB * BS * Hkv * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= MB * BS, "sequence length out of its block table");
    for (int64_t j = 0; j < (sl[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < NB, "block id out of the cache");
  }
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t len = sl[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      scores.resize(G * n);
      const float* qb = qp + (b * Hq + h * G) * D;
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
      std::copy(acc.begin(), acc.end(), op + (b * Hq + h * G) * D);
    }
  });
  return out;
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
        build = cache / f"edgellm_cpu_attention_{key}"
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
                name=f"edgellm_cpu_attention_{key}",
                cpp_sources=[SOURCE],
                functions=["decode_attention"],
                extra_cflags=["-O3", "-march=native"],
                build_directory=str(build),
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the reference is still correct
            _failed = True
            logger.warning("C++ decode attention unavailable (%s: %s); using the torch reference",
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
        raise RuntimeError("the C++ decode attention is not available")
    return module.decode_attention(query.contiguous(), kv_cache, block_tables, seq_lens, float(scale),
                                   int(sliding_window or 0))
