"""C++ kernels for fp32 models on CPU (both --cpu-quant modes): decode attention over the
paged KV cache, and a fused decode pass over all decoder layers.

decode_attention: the torch reference (paged_attention.paged_attention_ref)
gathers every sequence's blocks into a contiguous copy and runs SDPA with an
additive mask: three passes over the context and ~10 torch ops per layer. This
kernel reads K and V straight from the pages, once each, with one program per
(sequence, kv head) spread over torch's intra-op threads (at::parallel_for):
the G query heads sharing that kv head (GQA) score every position, softmax in
fp32, then accumulate V. With AVX-512 (the build is for the host ISA) and a head
size that is a multiple of 16, both passes go 16 tokens at a time with every
head of the item over the tile while it is in L1 and the next tile prefetched
(pages sit anywhere in the cache); the 16 scores of a tile come out of one
transpose-and-add tree, and the V accumulators stay in registers over the tile.
Scalar loops otherwise. Summation order is the same either way. Built with
-fopenmp so at::parallel_for really runs on torch's threads (it is inline
OpenMP; without the flag it is a serial loop); 8 sequences x 600 tokens,
SmolLM2's 3 kv heads: 0.95 -> 0.34 ms per layer. Same cache layout as
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
# -fopenmp: at::parallel_for is inline and runs its loop through OpenMP pragmas, which a build
# without the flag ignores (serial). The module then shares torch's libgomp.so.1 (loaded first,
# same soname), so torch.set_num_threads governs both.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#include <c10/util/Float8_e4m3fn.h>
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

// One cached K or V row as floats: fp32 rows are read in place; fp8 (e4m3fn) rows are decoded
// exactly into `buf` (AVX-512: e4m3's bit fields placed into fp16's give value / 256, then fp16
// -> fp32; elsewhere c10's conversion).
static inline const float* kv_row(const uint8_t* p, float* buf, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 k256 = _mm512_set1_ps(256.f);
  for (; d + 16 <= D; d += 16) {
    const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d)));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7));
    _mm512_storeu_ps(buf + d, _mm512_mul_ps(_mm512_cvtph_ps(half), k256));
  }
#endif
  for (; d < D; ++d) buf[d] = static_cast<float>(c10::Float8_e4m3fn(p[d], c10::Float8_e4m3fn::from_bits()));
  return buf;
}

#if defined(__AVX512F__)
// exp(v), v clamped to [-87.3, 88.7]: range reduction by ln 2 (Cody-Waite), a degree-6 Taylor
// polynomial on |r| <= ln2 / 2 and scalef: within 2 ulp of expf.
static inline __m512 exp512(__m512 v) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2hi = _mm512_set1_ps(0.693359375f), ln2lo = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 c2 = _mm512_set1_ps(1.f / 2), c3 = _mm512_set1_ps(1.f / 6), c4 = _mm512_set1_ps(1.f / 24);
  const __m512 c5 = _mm512_set1_ps(1.f / 120), c6 = _mm512_set1_ps(1.f / 720), one = _mm512_set1_ps(1.f);
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, ln2hi, v);
  r = _mm512_fnmadd_ps(k, ln2lo, r);
  __m512 p = _mm512_fmadd_ps(c6, r, c5);
  p = _mm512_fmadd_ps(p, r, c4);
  p = _mm512_fmadd_ps(p, r, c3);
  p = _mm512_fmadd_ps(p, r, c2);
  p = _mm512_fmadd_ps(p, r, one);
  p = _mm512_fmadd_ps(p, r, one);
  return _mm512_scalef_ps(p, k);
}
#endif

// x[i] = exp(x[i] - mx) for i < n (every x[i] <= mx), returning their sum (AVX-512: exp512;
// elsewhere std::exp).
static inline float exp_shifted_sum(float* x, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmx));
    _mm512_storeu_ps(x + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

// out[g] = q_g . k for the G query heads sharing one K row (q_g = q + g * D): k read once.
static inline void dots(const float* q, const float* k, int64_t D, int64_t G, float* out) {
#if defined(__AVX512F__)
  if (G <= 8 && D % 16 == 0) {
    __m512 acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kv = _mm512_loadu_ps(k + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) out[g] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) out[g] = dot(q + g * D, k, D);
}

// acc_g += p[g] * v for the G heads sharing one V row (acc_g = acc + g * D): v read once.
static inline void axpys(float* acc, const float* p, int64_t pstride, const float* v, int64_t D, int64_t G) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 vv = _mm512_loadu_ps(v + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * pstride]), vv, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, p[g * pstride], v, D);
}

template <typename T>
static inline const float* load_row(const T* p, float* buf, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    return kv_row(p, buf, D);
  }
}

#if defined(__AVX512F__)
// 16 K or V values as fp32: fp32 in place; fp8 e4m3 codes as in kv_row.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}

// Lane t of the result = the sum of v[t]'s 16 lanes: a transpose-and-add tree (45 shuffles and
// adds for 16 sums, where 16 separate reductions take ~130 and serialize on their latency).
static inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // blocks [x0+x2, x1+x3, y0+y2, y1+y3] of (x, y) = (v[2i], v[2i+1])
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // block k: 4 partial sums of v[4i + k]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // block k: lanes 0, 2 partials of v[8i + k], lanes 1, 3 of v[8i + 4 + k]
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  // block k lane j: the sum of v[k + 4j]
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// out[t] = mul * (q . row_t) for the cnt <= 16 rows of a tile (D % 16 == 0).
template <typename T>
static inline void score_tile(const float* q, const T* const* rows, int64_t off, int cnt, int64_t D, float mul,
                              float* out) {
  __m512 part[16];
  for (int t = 0; t < 16; ++t) {
    if (t < cnt) {
      const T* r = rows[t] + off;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), load16(r));
      for (int64_t d = 16; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(r + d), a);
      part[t] = a;
    } else {
      part[t] = _mm512_setzero_ps();
    }
  }
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << cnt) - 1), _mm512_mul_ps(hsum16(part), _mm512_set1_ps(mul)));
}

// out[g * D + c * 16 ..] (+)= sum_t p[g * pstride + t] * row_t[c * 16 ..] over the n tokens of a
// tile, for NG heads and NC 16-wide chunks of the row, the NG x NC accumulators in registers.
template <typename T, int NG, int NC>
static void pv_block(const float* p, int64_t pstride, const T* const* rows, int64_t off, int64_t n, float* out,
                     int64_t D, bool first) {
  __m512 acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + g * D + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const T* r = rows[t] + off;
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(r + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * pstride + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(pb, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * D + 16 * c, acc[g][c]);
}

template <typename T, int NG>
static void pv_heads(const float* p, int64_t pstride, const T* const* rows, int64_t off, int64_t n, float* out,
                     int64_t D, bool first) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    switch (std::min<int64_t>(4, (D - c0) / 16)) {
      case 4: pv_block<T, NG, 4>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      case 3: pv_block<T, NG, 3>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      case 2: pv_block<T, NG, 2>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      default: pv_block<T, NG, 1>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
    }
  }
}

// Prefetch the rows of tokens [t0, t1) (`bytes` from each row's start) into L1.
template <typename T>
static inline void prefetch_rows(const T* const* rows, int64_t t0, int64_t t1, int64_t off, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* f = reinterpret_cast<const char*>(rows[t] + off);
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(f + l, _MM_HINT_T0);
  }
}

// One work item of attend() on AVX-512 (D % 16 == 0): M sequences ("members") whose first
// `shared` context tokens are the same cached pages (M = 1, shared = 0: one sequence). Member m has
// query heads qh[m] [GH, D] (GH = hpi * G, kv head h0 + g / G), n[m] context tokens with rows[m][t]
// pointing at head h0's K row of token t (V at + voff), output out[m] and scores[m] [GH, n[m]].
// Both passes go 16 tokens (a page, at the default block size) at a time, every head of the item
// over one tile while it is in L1, the next tile prefetched (pages sit anywhere in the cache and
// the hardware prefetcher stops at each one); a shared tile serves every member before the next
// is read, so a cached system prompt is read from memory once per item, not once per sequence.
// Each member's sums run in the same order either way.
template <typename T>
static void attend_members(const float* const* qh, float* const* out, const T* const* const* rows, const int64_t* n,
                           int64_t M, int64_t shared, int64_t voff, int64_t hpi, int64_t G, int64_t D, float ksc,
                           float v_mul, float* const* scores) {
  const int64_t GH = hpi * G;
  const int64_t bytes = hpi * D * static_cast<int64_t>(sizeof(T));  // one token's K (or V) rows
  shared -= shared % 16;  // whole tiles
  auto score_tiles = [&](int64_t m, int64_t t0) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n[m] - t0));
    for (int64_t hq = 0; hq < GH; ++hq)
      score_tile(qh[m] + hq * D, rows[m] + t0, (hq / G) * D, cnt, D, ksc, scores[m] + hq * n[m] + t0);
  };
  auto pv_tiles = [&](int64_t m, int64_t t0) {
    const int64_t cnt = std::min<int64_t>(16, n[m] - t0);
    for (int64_t hh = 0; hh < hpi; ++hh) {
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const float* p = scores[m] + (hh * G + g0) * n[m] + t0;
        float* o = out[m] + (hh * G + g0) * D;
        const int64_t off = voff + hh * D;
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: pv_heads<T, 4>(p, n[m], rows[m] + t0, off, cnt, o, D, t0 == 0); break;
          case 3: pv_heads<T, 3>(p, n[m], rows[m] + t0, off, cnt, o, D, t0 == 0); break;
          case 2: pv_heads<T, 2>(p, n[m], rows[m] + t0, off, cnt, o, D, t0 == 0); break;
          default: pv_heads<T, 1>(p, n[m], rows[m] + t0, off, cnt, o, D, t0 == 0); break;
        }
      }
    }
  };
  for (int64_t t0 = 0; t0 < shared; t0 += 16) {
    prefetch_rows(rows[0], t0 + 16, std::min(shared, t0 + 32), 0, bytes);
    for (int64_t m = 0; m < M; ++m) score_tiles(m, t0);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t t0 = shared; t0 < n[m]; t0 += 16) {
      prefetch_rows(rows[m], t0 + 16, std::min(n[m], t0 + 32), 0, bytes);
      score_tiles(m, t0);
    }
    for (int64_t g = 0; g < GH; ++g) {
      float* sg = scores[m] + g * n[m];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n[m]; ++t) mx = std::max(mx, sg[t]);
      const float inv = v_mul / exp_shifted_sum(sg, n[m], mx);
      for (int64_t t = 0; t < n[m]; ++t) sg[t] *= inv;
    }
  }
  prefetch_rows(rows[0], 0, std::min<int64_t>(n[0], 16), voff, bytes);
  for (int64_t t0 = 0; t0 < shared; t0 += 16) {
    prefetch_rows(rows[0], t0 + 16, std::min(shared, t0 + 32), voff, bytes);
    for (int64_t m = 0; m < M; ++m) pv_tiles(m, t0);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t t0 = shared; t0 < n[m]; t0 += 16) {
      prefetch_rows(rows[m], t0 + 16, std::min(n[m], t0 + 32), voff, bytes);
      pv_tiles(m, t0);
    }
  }
}

// Work items of attend(): sequences that share at least kMinShared leading context tokens as the
// same pages (a cached system prompt) go together, one kv head per item, split into enough
// member chunks for the threads; the rest one sequence each (with all its kv heads when there are
// enough sequences for the threads: its K/V tokens are then read as whole contiguous rows).
struct AttnItem {
  std::vector<int64_t> members;
  int64_t h0, hpi, shared;
};

static std::vector<AttnItem> attn_items(const int64_t* bt, int64_t MB, const int64_t* sl, int64_t B, int64_t BS,
                                        int64_t Hkv, int64_t window) {
  constexpr int64_t kMinShared = 64;
  const int64_t nth = at::get_num_threads();
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> group_shared;
  std::vector<int64_t> single;
  std::vector<bool> done(B, false);
  for (int64_t b = 0; b < B; ++b) {
    if (done[b]) continue;
    std::vector<int64_t> g{b};
    int64_t blocks = MB;
    for (int64_t c = b + 1; c < B && window <= 0; ++c) {
      if (done[c] || bt[c * MB] != bt[b * MB]) continue;
      const int64_t full = std::min(sl[b], sl[c]) / BS;  // blocks wholly inside both contexts
      int64_t j = 0;
      while (j < full && bt[c * MB + j] == bt[b * MB + j]) ++j;
      if (j * BS < kMinShared) continue;
      g.push_back(c);
      blocks = std::min(blocks, j);
    }
    if (g.size() < 2) {
      single.push_back(b);
      continue;
    }
    for (int64_t c : g) done[c] = true;
    groups.push_back(g);
    group_shared.push_back(blocks * BS);
  }
  std::vector<AttnItem> items;
  const int64_t hpi = static_cast<int64_t>(single.size()) >= 2 * nth ? Hkv : 1;
  for (int64_t b : single)
    for (int64_t h0 = 0; h0 < Hkv; h0 += hpi) items.push_back({{b}, h0, hpi, 0});
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t M = static_cast<int64_t>(groups[i].size());
    const int64_t want = (2 * nth + Hkv * static_cast<int64_t>(groups.size()) - 1) /
                         (Hkv * static_cast<int64_t>(groups.size()));
    const int64_t chunks = std::max<int64_t>(1, std::min(M, want));
    for (int64_t c = 0; c < chunks; ++c) {
      std::vector<int64_t> part(groups[i].begin() + c * M / chunks, groups[i].begin() + (c + 1) * M / chunks);
      for (int64_t h0 = 0; h0 < Hkv; ++h0) items.push_back({part, h0, 1, group_shared[i]});
    }
  }
  return items;
}
#endif

// Decode attention for B sequences, one query token each. q row b at q + b * q_stride (Hq heads of
// D), output row b at out + b * out_stride. K/V pages: kc / vc [NB, BS, Hkv, D] (fp32, or fp8
// codes with k_mul / v_mul their scales). block tables [B, MB] int64, seq_lens [B] (context incl.
// this token), window <= 0: none.
template <typename T>
static void attend(const float* q, int64_t q_stride, float* out, int64_t out_stride, const T* kc,
                   const T* vc, int64_t BS, int64_t Hkv, int64_t D, int64_t G, const int64_t* bt,
                   int64_t MB, const int64_t* sl, int64_t B, float sc, int64_t window, float k_mul = 1.f,
                   float v_mul = 1.f) {
  // Work items: one sequence with all its kv heads when there are enough sequences for the
  // threads (its K/V tokens are then read as whole contiguous rows), else one (sequence, kv head).
  const int64_t hpi = B >= 2 * at::get_num_threads() ? Hkv : 1;  // kv heads per item
  const int64_t GH = G * hpi;  // query heads per item
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const std::vector<AttnItem> items = attn_items(bt, MB, sl, B, BS, Hkv, window);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<std::vector<float>> scores;
      std::vector<std::vector<const T*>> rows;
      std::vector<const float*> qh;
      std::vector<float*> oh, sp;
      std::vector<const T* const*> rp;
      std::vector<int64_t> n;
      const int64_t row = Hkv * D;
      for (int64_t i = begin; i < end; ++i) {
        const AttnItem& it = items[i];
        const int64_t M = static_cast<int64_t>(it.members.size());
        scores.resize(M);
        rows.resize(M);
        qh.resize(M), oh.resize(M), sp.resize(M), rp.resize(M), n.resize(M);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t b = it.members[m], len = sl[b];
          const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
          n[m] = len - lo;
          scores[m].resize(it.hpi * G * n[m]);
          rows[m].resize(n[m]);
          for (int64_t t = lo; t < len; ++t)
            rows[m][t - lo] = kc + (bt[b * MB + t / BS] * BS + t % BS) * row + it.h0 * D;
          qh[m] = q + b * q_stride + it.h0 * G * D;
          oh[m] = out + b * out_stride + it.h0 * G * D;
          sp[m] = scores[m].data();
          rp[m] = rows[m].data();
        }
        attend_members<T>(qh.data(), oh.data(), rp.data(), n.data(), M, it.shared, vc - kc, it.hpi, G, D,
                          sc * k_mul, v_mul, sp.data());
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * (Hkv / hpi), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(GH * D);
    std::vector<float> buf(D);
    std::vector<float> dk(G);
    const float ksc = sc * k_mul;
    const int64_t row = Hkv * D;  // one token's K (or V) in a page
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (Hkv / hpi), h0 = (i % (Hkv / hpi)) * hpi;
      const int64_t len = sl[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      scores.resize(GH * n);
      const float* qb = q + b * q_stride + h0 * G * D;
      // page by page: no division per position
      for (int64_t j = lo / BS; j * BS < len; ++j) {
        const T* page = kc + (bt[b * MB + j] * BS * Hkv + h0) * D;
        const int64_t t1 = std::min(len, (j + 1) * BS);
        for (int64_t t = std::max(lo, j * BS); t < t1; ++t) {
          const T* tok = page + (t - j * BS) * row;
          for (int64_t hh = 0; hh < hpi; ++hh) {
            dots(qb + hh * G * D, load_row(tok + hh * D, buf.data(), D), D, G, dk.data());
            for (int64_t g = 0; g < G; ++g) scores[(hh * G + g) * n + (t - lo)] = dk[g] * ksc;
          }
        }
      }
      for (int64_t g = 0; g < GH; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        const float sum = exp_shifted_sum(sg, n, mx);
        const float inv = v_mul / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = lo / BS; j * BS < len; ++j) {
        const T* page = vc + (bt[b * MB + j] * BS * Hkv + h0) * D;
        const int64_t t1 = std::min(len, (j + 1) * BS);
        for (int64_t t = std::max(lo, j * BS); t < t1; ++t) {
          const T* tok = page + (t - j * BS) * row;
          for (int64_t hh = 0; hh < hpi; ++hh)
            axpys(acc.data() + hh * G * D, scores.data() + hh * G * n + (t - lo), n,
                  load_row(tok + hh * D, buf.data(), D), D, G);
        }
      }
      std::copy(acc.begin(), acc.end(), out + b * out_stride + h0 * G * D);
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

static void check_cache(const torch::Tensor& kv_cache, int64_t D, bool fp8_ok = false) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() &&
              (kv_cache.scalar_type() == torch::kFloat ||
               (fp8_ok && kv_cache.scalar_type() == at::ScalarType::Float8_e4m3fn)),
              "kv_cache: [2, NB, BS, Hkv, D] contiguous, fp32 (or fp8 e4m3fn in decode_layers)");
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
  attend<float>(q.data_ptr<float>(), Hq * D, out.data_ptr<float>(), Hq * D, kc, kc + NB * BS * Hkv * D, BS, Hkv, D,
         Hq / Hkv, block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B,
         static_cast<float>(scale), window);
  return out;
}

// y = x W^T for a bf16 weight in oneDNN's blocked layout (quant/backends.pack_bf16): the op the
// Python path calls, through the dispatcher (it has no C++ API of its own).
static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// y = x W^T (+ bias) for one linear: int4 GEMV (bf16 activations) up to max_rows rows when packed
// is given, else the dense matrix in its own dtype (bf16, plain or oneDNN-blocked, or fp32).
// Empty tensors mean "absent".
static torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                            int64_t group, const torch::Tensor& dense, const torch::Tensor& bias, int64_t max_rows) {
  torch::Tensor y;
  if (packed.numel() > 0 && x.size(0) <= max_rows) {
    y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), packed, group, sz).to(at::kFloat);
  } else if (dense.is_mkldnn()) {
    y = packed_linear(x.to(at::kBFloat16), dense).to(at::kFloat);
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

// silu(gate) * up for gu [T, 2 I] (gate | up per row; bf16 or fp32, rows contiguous) -> [T, I] bf16,
// computed in fp32 and rounded once to bf16 (nearest even). The MLP of prefill-sized steps in
// CPU fast mode: torch's bf16 silu and mul are two passes, each widening to fp32 and rounding.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.stride(1) == 1, "gu: [T, 2 I], rows contiguous");
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 || gu.scalar_type() == at::kFloat, "gu: bf16 or fp32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, rs = gu.stride(0);
  auto out = torch::empty({T, I}, gu.options().dtype(at::kBFloat16));
  pybind11::gil_scoped_release no_gil;
  const bool bf = gu.scalar_type() == at::kBFloat16;
  const c10::BFloat16* gb = bf ? gu.data_ptr<c10::BFloat16>() : nullptr;
  const float* gf = bf ? nullptr : gu.data_ptr<float>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t i = 0;
#if defined(__AVX512BF16__)
      for (; i + 16 <= I; i += 16) {
        __m512 g, u;
        if (bf) {
          const __m256i gr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + t * rs + i));
          const __m256i ur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + t * rs + I + i));
          g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(gr), 16));
          u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ur), 16));
        } else {
          g = _mm512_loadu_ps(gf + t * rs + i);
          u = _mm512_loadu_ps(gf + t * rs + I + i);
        }
        const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(sig, u));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t * I + i), (__m256i)y);
      }
#endif
      for (; i < I; ++i) {
        const float g = bf ? static_cast<float>(gb[t * rs + i]) : gf[t * rs + i];
        const float u = bf ? static_cast<float>(gb[t * rs + I + i]) : gf[t * rs + I + i];
        op[t * I + i] = c10::BFloat16(g / (1.f + std::exp(-g)) * u);
      }
    }
  });
  return out;
}

// RMSNorm of x [T, H] fp32 (rows contiguous) with weight w [H] fp32 -> [T, H] fp32, rows spread
// over the threads. torch's CPU rms_norm is six passes (pow, mean, add, rsqrt, two muls): on a
// 2528 x 576 prefill step 0.77 ms, this ~0.1 ms. Summed in another order than torch: ~1e-7.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: [T, H] fp32, rows contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1), "w: [H] fp32");
  const int64_t T = x.size(0), H = x.size(1), rs = x.stride(0);
  auto out = torch::empty({T, H}, x.options());
  pybind11::gil_scoped_release no_gil;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* r = xp + t * rs;
      float* o = op + t * H;
      int64_t i = 0;
      float ss = 0.f;
#if defined(__AVX512F__)
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      for (; i + 32 <= H; i += 32) {
        const __m512 u = _mm512_loadu_ps(r + i), v = _mm512_loadu_ps(r + i + 16);
        a0 = _mm512_fmadd_ps(u, u, a0);
        a1 = _mm512_fmadd_ps(v, v, a1);
      }
      for (; i + 16 <= H; i += 16) {
        const __m512 u = _mm512_loadu_ps(r + i);
        a0 = _mm512_fmadd_ps(u, u, a0);
      }
      ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
      for (; i < H; ++i) ss += r[i] * r[i];
      const float k = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
      i = 0;
#if defined(__AVX512F__)
      const __m512 kv = _mm512_set1_ps(k);
      for (; i + 16 <= H; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + i), kv), _mm512_loadu_ps(wp + i)));
#endif
      for (; i < H; ++i) o[i] = r[i] * k * wp[i];
    }
  });
  return out;
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
                            int64_t intermediate, double eps, double scale, int64_t int4_max_rows,
                            std::vector<double> kv_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [B, H] fp32");
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  TORCH_CHECK(w.size() % PER_LAYER == 0 && meta.size() == w.size() / PER_LAYER * 5, "per-layer tensors");
  const int64_t B = x.size(0), H = x.size(1), D = head_dim, Hq = num_heads, Hkv = num_kv_heads;
  const int64_t G = Hq / Hkv, QKV = (Hq + 2 * Hkv) * D, I = intermediate;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D, "cos/sin [B, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == B, "slots: [B] int64");
  const int64_t L = w.size() / PER_LAYER;
  if (B == 0 || L == 0) return x;
  check_cache(w[PER_LAYER - 1], D, true);
  TORCH_CHECK(kv_scales.size() == 2 * static_cast<size_t>(w.size() / PER_LAYER), "two kv scales per layer");
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
    check_cache(cache, D, true);
    TORCH_CHECK(cache.size(1) == NB && cache.size(2) == BS && cache.size(3) == Hkv, "kv caches differ across layers");
    const bool fp8 = cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
    const float k_scale = static_cast<float>(kv_scales[2 * l]), v_scale = static_cast<float>(kv_scales[2 * l + 1]);
    // attention block
    float* hp = h.data_ptr<float>();
    const float* n1 = t[0].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) rmsnorm(xp + b * H, n1, hp + b * H, H, static_cast<float>(eps));
    auto qkv = linear(h, t[1], t[2], m[0], t[3], t[4], int4_max_rows).contiguous();
    TORCH_CHECK(qkv.size(1) == QKV, "qkv width");
    float* qp = qkv.data_ptr<float>();
    rotate_rows(qp, QKV, cp, snp, B, Hq + Hkv, D);  // q heads, then k heads
    if (fp8) {  // as kernels/paged_attention.write_kv_ref: clamp(x / scale, +-448), round to e4m3
      uint8_t* kc = reinterpret_cast<uint8_t*>(cache.data_ptr());
      uint8_t* vc = kc + NB * BS * Hkv * D;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t slot = sp[b];
        for (int64_t j = 0; j < Hkv * D; ++j) {
          const float kq = std::min(std::max(qp[b * QKV + Hq * D + j] / k_scale, -448.f), 448.f);
          const float vq = std::min(std::max(qp[b * QKV + (Hq + Hkv) * D + j] / v_scale, -448.f), 448.f);
          kc[slot * Hkv * D + j] = c10::Float8_e4m3fn(kq).x;
          vc[slot * Hkv * D + j] = c10::Float8_e4m3fn(vq).x;
        }
      }
      attend<uint8_t>(qp, QKV, attn.data_ptr<float>(), Hq * D, kc, vc, BS, Hkv, D, G,
                      block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B,
                      static_cast<float>(scale), m[4], k_scale, v_scale);
    } else {
      float* kc = cache.data_ptr<float>();
      float* vc = kc + NB * BS * Hkv * D;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t slot = sp[b];
        std::copy(qp + b * QKV + Hq * D, qp + b * QKV + (Hq + Hkv) * D, kc + slot * Hkv * D);
        std::copy(qp + b * QKV + (Hq + Hkv) * D, qp + (b + 1) * QKV, vc + slot * Hkv * D);
      }
      attend<float>(qp, QKV, attn.data_ptr<float>(), Hq * D, kc, vc, BS, Hkv, D, G,
                    block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B,
                    static_cast<float>(scale), m[4]);
    }
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
        key = hashlib.sha256((SOURCE + " ".join(CFLAGS) + _cpu_flags() + torch.__version__).encode()).hexdigest()[:16]
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
                functions=["decode_attention", "decode_layers", "rotate_", "silu_mul", "rms_norm"],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
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


def decode_tables(block_tables: torch.Tensor, seq_lens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `rows` sequences' block tables (int64, contiguous) and context lengths as the
    kernels take them."""
    return block_tables[:rows].long().contiguous(), torch.tensor(seq_lens[:rows])


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] fp32 with weight [H] fp32, rows over the threads (fp32 sums in another
    order than torch's: ~1e-7 relative)."""
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    return module.rms_norm(x, weight, float(eps))


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu [T, 2 * I] (bf16 or fp32) -> [T, I] bf16, rounded once."""
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    return module.silu_mul(gu)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rotary (neox halves) in place on the first `heads` heads of each row of x [T, W] fp32 (a
    qkv projection: q heads, then k heads); cos/sin [T, head_dim]. One pass instead of torch's
    five (mul, neg, cat, mul, add over copies)."""
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels are not available")
    return module.rotate_(x, cos.contiguous(), sin.contiguous(), int(heads), int(head_dim))
