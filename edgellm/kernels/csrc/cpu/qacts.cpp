// Activation quantization for the integer-dot matmuls (the contract: qacts.h).
#include "qacts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {
namespace {

#if defined(__AVX2__)
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

}  // namespace

void quantize_row(const float* x, int64_t K, int64_t group, int8_t* a, float* d, float* dsum, int32_t* isum) {
  const int64_t per = std::max<int64_t>(group / QB, 1);  // blocks per group (group 16: 1, per half)
  for (int64_t g = 0; g < K / std::max<int64_t>(group, QB); ++g) {
    float ds = 0.f;
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      const float* xb = x + b * QB;
      int8_t* ab = a + b * QB;
#if defined(__AVX2__)
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
      }
      const float amax = hmax8(mx);
      const float db = amax / 127.f;
      const __m256 id = _mm256_set1_ps(db > 0.f ? 1.f / db : 0.f);
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ab),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const int32_t lo = hsum8i(_mm256_add_epi32(r[0], r[1])), hi = hsum8i(_mm256_add_epi32(r[2], r[3]));
#else
      float amax = 0.f;
      for (int64_t j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float db = amax / 127.f;
      const float id = db > 0.f ? 1.f / db : 0.f;
      int32_t lo = 0, hi = 0;
      for (int64_t j = 0; j < QB; ++j) {
        ab[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        (j < QB / 2 ? lo : hi) += ab[j];
      }
#endif
      d[b] = db;
      if (isum != nullptr) {
        isum[2 * b] = lo;
        isum[2 * b + 1] = hi;
      }
      if (group < QB) {
        dsum[2 * b] = db * static_cast<float>(lo);
        dsum[2 * b + 1] = db * static_cast<float>(hi);
      } else {
        ds += db * static_cast<float>(lo + hi);
      }
    }
    if (group >= QB) dsum[g] = ds;
  }
}

void quantize_into(const float* x, int64_t M, int64_t K, int64_t group, int8_t* a, float* d, float* dsum,
                   int32_t* isum) {
  const int64_t nb = K / QB, G = K / group;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, group, a + m * K, d + m * nb, dsum + m * G, isum ? isum + m * 2 * nb : nullptr);
  });
}

QActs ActScratch::quantize(const float* x, int64_t M, int64_t rows, int64_t K, int64_t group) {
  const int64_t nb = K / QB, G = K / group;
  rows = std::max(rows, M);
  if (static_cast<int64_t>(a.size()) < rows * K) a.resize(rows * K);
  if (static_cast<int64_t>(d.size()) < rows * nb) d.resize(rows * nb);
  if (static_cast<int64_t>(dsum.size()) < rows * G) dsum.resize(rows * G);
  if (static_cast<int64_t>(isum.size()) < rows * 2 * nb) isum.resize(rows * 2 * nb);
  quantize_into(x, M, K, group, a.data(), d.data(), dsum.data(), isum.data());
  if (rows > M) {
    std::memset(a.data() + M * K, 0, (rows - M) * K);
    std::fill(d.begin() + M * nb, d.begin() + rows * nb, 0.f);
    std::fill(dsum.begin() + M * G, dsum.begin() + rows * G, 0.f);
    std::fill(isum.begin() + M * 2 * nb, isum.begin() + rows * 2 * nb, 0);
  }
  return QActs{a.data(), d.data(), dsum.data(), isum.data(), K, nb, G};
}

ActScratch& act_scratch() {
  thread_local ActScratch scratch;
  return scratch;
}

}  // namespace edgellm::cpu
