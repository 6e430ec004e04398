// The scores of bf16 queries against bf16 keys in fp32, and their softmax numerators (the contract:
// prefix_softmax.h), for prefill attention over a cached prefix on CPUs with AVX512-BF16 and no AMX.
//
// k is repacked per call into pairs of dims for 16 keys at a time, kp[b][d / 2][n] = the 32 bits
// of (k[b][n][d], k[b][n][d + 1]), keys past N zero: one vdpbf16ps then takes the two dims of 16
// keys (the zmm lanes are the keys) against the same two dims of one query broadcast. A
// micro-tile of R query rows x 64 keys keeps 4 R fp32 accumulators in registers over all of D.
// A task's 16 rows of scores go to a buffer of the thread's, and each row's max, exp (vec.h's
// exp_shifted_sum) and bf16 rounding happen while the row is in cache. Without AVX512-BF16: the
// same sums in scalar fp32 code.
#include "prefix_softmax.h"

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {
namespace {

constexpr int64_t KT = 16;  // keys per zmm

#if defined(__AVX512BF16__)
constexpr int MR = 4;  // query rows per micro-tile
constexpr int NT = 4;  // zmm key tiles per micro-tile (64 keys)

// rows [m0, m0 + R) x key tiles [j0, j0 + T) of batch b
template <int R, int T>
void tile(const uint32_t* q, const uint32_t* kp, float* s, int64_t m0, int64_t j0, int64_t D2, int64_t NP,
          int64_t N, float scale) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D2; ++dp) {
    __m512bh kv[T];
    for (int t = 0; t < T; ++t)
      kv[t] = (__m512bh)_mm512_loadu_si512(kp + dp * NP + (j0 + t) * KT);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[(m0 + r) * D2 + dp]));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qv, kv[t]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int t = 0; t < T; ++t) {
    const int64_t n0 = (j0 + t) * KT, valid = std::min<int64_t>(KT, N - n0);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(s + (m0 + r) * N + n0, mask, _mm512_mul_ps(acc[r][t], sv));
  }
}

template <int R>
void row_block(const uint32_t* q, const uint32_t* kp, float* s, int64_t m0, int64_t D2, int64_t NP, int64_t N,
               float scale) {
  const int64_t tiles = NP / KT;
  int64_t j = 0;
  for (; j + NT <= tiles; j += NT) tile<R, NT>(q, kp, s, m0, j, D2, NP, N, scale);
  for (; j < tiles; ++j) tile<R, 1>(q, kp, s, m0, j, D2, NP, N, scale);
}

void rows(const uint32_t* q, const uint32_t* kp, float* s, int64_t m_begin, int64_t m_end, int64_t D2, int64_t NP,
          int64_t N, float scale) {
  int64_t m = m_begin;
  for (; m + MR <= m_end; m += MR) row_block<MR>(q, kp, s, m, D2, NP, N, scale);
  for (; m < m_end; ++m) row_block<1>(q, kp, s, m, D2, NP, N, scale);
}
#else
inline float bf16_at(uint32_t pair, int hi) {
  const uint32_t bits = (hi ? pair >> 16 : pair & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void rows(const uint32_t* q, const uint32_t* kp, float* s, int64_t m_begin, int64_t m_end, int64_t D2, int64_t NP,
          int64_t N, float scale) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t dp = 0; dp < D2; ++dp) {
        const uint32_t a = q[m * D2 + dp], b = kp[dp * NP + n];
        acc += bf16_at(a, 0) * bf16_at(b, 0) + bf16_at(a, 1) * bf16_at(b, 1);
      }
      s[m * N + n] = acc * scale;
    }
  }
}
#endif

float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float top = -INFINITY;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    top = _mm512_reduce_max_ps(v);
  }
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// dst[n] = bf16(src[n]), rounded to nearest even (vcvtneps2bf16 where built in)
void to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> prefix_softmax_bf16(const at::Tensor& q, const at::Tensor& k,
                                                                   double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16,
              "q [B, M, D] and k [B, N, D]: bf16");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous(), "q and k: contiguous");
  const int64_t B = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == D && D % 2 == 0 && D > 0 && N > 0, "k: [B, N > 0, D] like q, D even");
  auto p = at::empty({B, M, N}, q.options());
  auto mx = at::empty({B, M}, q.options().dtype(at::kFloat));
  auto l = at::empty({B, M}, q.options().dtype(at::kFloat));
  if (B == 0 || M == 0) return {p, mx, l};
  const int64_t D2 = D / 2, NP = (N + KT - 1) / KT * KT;
  pybind11::gil_scoped_release no_gil;
  // kp[b][dp][n]: the pair (k[b][n][2 dp], k[b][n][2 dp + 1]), keys past N zero
  std::vector<uint32_t> kp(static_cast<size_t>(B * D2 * NP), 0u);
  const auto* kw = reinterpret_cast<const uint32_t*>(k.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / N, n = i % N;
      for (int64_t dp = 0; dp < D2; ++dp) kp[(b * D2 + dp) * NP + n] = kw[i * D2 + dp];
    }
  });
  const auto* qw = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  auto* pp = p.data_ptr<at::BFloat16>();
  float *mp = mx.data_ptr<float>(), *lp = l.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  constexpr int64_t chunk = 16;  // rows per task
  const int64_t per_b = (M + chunk - 1) / chunk;
  at::parallel_for(0, B * per_b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(chunk * N));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_b, m0 = (task % per_b) * chunk, m1 = std::min(M, m0 + chunk);
      rows(qw + (b * M + m0) * D2, kp.data() + b * D2 * NP, s.data(), 0, m1 - m0, D2, NP, N, sc);
      for (int64_t r = 0; r < m1 - m0; ++r) {
        float* row = s.data() + r * N;
        const float top = row_max(row, N);
        const int64_t out = b * M + m0 + r;
        mp[out] = top;
        lp[out] = exp_shifted_sum(row, N, top);
        to_bf16(row, pp + out * N, N);
      }
    }
  });
  return {p, mx, l};
}

}  // namespace edgellm::cpu
