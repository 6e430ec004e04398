// Vector helpers shared by the CPU kernels (kernels/csrc/cpu/*.cpp): dot products and axpys,
// K/V rows as fp32 (fp32 in place, fp8 e4m3 decoded), exp and the softmax's shifted exp-sum, the
// 16-way horizontal sum. AVX-512 where the build's ISA has it (the module is built for the host),
// scalar loops otherwise; header-only (static inline), so every kernel file inlines its own copy.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {

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
#if defined(__AVX512F__)
// 16 K or V values as fp32: fp32 in place; fp8 e4m3 codes decoded as below.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}
#endif

static inline const float* kv_row(const uint8_t* p, float* buf, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(buf + d, load16(p + d));
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
#endif

}  // namespace edgellm::cpu
