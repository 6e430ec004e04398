// Vector helpers shared by the CPU kernels (edgellm/kernels/csrc/cpu/*.cpp): dot products and axpys,
// K/V rows as fp32 (fp32 in place, fp16 and fp8 e4m3 decoded), exp and the softmax's shifted exp-sum, the
// 16-way horizontal sum. V16 is 16 fp32 lanes: one zmm register on AVX-512, two ymm registers on
// AVX2 (+ FMA, F16C: every x86-64-v3 CPU), so one kernel source serves both levels; EDGELLM_V16 is
// defined when either is built in, scalar loops serve the rest. Header-only (static inline), so
// every kernel file inlines its own copy.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define EDGELLM_V16 1
#endif

namespace edgellm::cpu {

#if defined(__AVX512F__)
using V16 = __m512;
constexpr int V16_PV_CHUNKS = 4;  // 16-lane accumulator chunks the P.V loop keeps per head (32 zmm)
static inline V16 v16_zero() { return _mm512_setzero_ps(); }
static inline V16 v16_set1(float a) { return _mm512_set1_ps(a); }
static inline V16 v16_load(const float* p) { return _mm512_loadu_ps(p); }
static inline V16 v16_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
static inline V16 v16_sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
static inline V16 v16_min(V16 a, V16 b) { return _mm512_min_ps(a, b); }
static inline V16 v16_max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
static inline V16 v16_fnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
static inline V16 v16_round(V16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline V16 v16_times_pow2(V16 p, V16 k) { return _mm512_scalef_ps(p, k); }  // p * 2^k
static inline V16 v16_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
static inline V16 v16_div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
static inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void v16_store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
static inline void v16_store_first(float* p, V16 v, int cnt) {  // lanes [0, cnt)
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << cnt) - 1), v);
}
static inline float v16_sum(V16 v) { return _mm512_reduce_add_ps(v); }
static inline float v16_hmax(V16 v) { return _mm512_reduce_max_ps(v); }
// 16 fp16 bit patterns -> fp32
static inline V16 v16_from_half(__m256i h) { return _mm512_cvtph_ps(h); }
#elif defined(EDGELLM_V16)
struct V16 {
  __m256 lo, hi;
};
constexpr int V16_PV_CHUNKS = 1;  // 16 ymm registers: one chunk of 4 heads' accumulators
static inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 v16_set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 v16_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 v16_min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline V16 v16_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V16 v16_fnmadd(V16 a, V16 b, V16 c) {  // c - a b
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline V16 v16_round(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// p * 2^k for integral k in [-126, 127]: 2^k built in the exponent field
static inline __m256 times_pow2_8(__m256 p, __m256 k) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline V16 v16_times_pow2(V16 p, V16 k) { return {times_pow2_8(p.lo, k.lo), times_pow2_8(p.hi, k.hi)}; }
static inline V16 v16_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 v16_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void v16_store(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
static inline void v16_store_first(float* p, V16 v, int cnt) {
  alignas(32) float tmp[16];
  v16_store(tmp, v);
  for (int i = 0; i < cnt; ++i) p[i] = tmp[i];
}
static inline float v16_sum(V16 v) {
  const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float v16_hmax(V16 v) {
  const __m256 m8 = _mm256_max_ps(v.lo, v.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
static inline V16 v16_from_half(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
#endif

static inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#if defined(EDGELLM_V16)
  V16 acc = v16_zero();
  for (; d + 16 <= n; d += 16) acc = v16_fmadd(v16_load(a + d), v16_load(b + d), acc);
  s = v16_sum(acc);
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float* y, float p, const float* x, int64_t n) {  // y += p * x
  int64_t d = 0;
#if defined(EDGELLM_V16)
  const V16 pv = v16_set1(p);
  for (; d + 16 <= n; d += 16) v16_store(y + d, v16_fmadd(pv, v16_load(x + d), v16_load(y + d)));
#endif
  for (; d < n; ++d) y[d] += p * x[d];
}

// One cached K or V row as floats: fp32 rows are read in place; fp16 and fp8 (e4m3fn) rows are
// decoded exactly into `buf` (fp16: F16C's conversion; e4m3: its bit fields placed into fp16's
// give value / 256, then fp16 -> fp32; without vectors c10's conversions).
#if defined(EDGELLM_V16)
// 16 K or V values as fp32: fp32 in place; fp16 and fp8 e4m3 codes decoded as below.
static inline V16 load16(const float* p) { return v16_load(p); }
static inline V16 load16(const c10::Half* p) {
  return v16_from_half(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline V16 load16(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7));
  return v16_mul(v16_from_half(half), v16_set1(256.f));
}
#endif

static inline const float* kv_row(const uint8_t* p, float* buf, int64_t D) {
  int64_t d = 0;
#if defined(EDGELLM_V16)
  for (; d + 16 <= D; d += 16) v16_store(buf + d, load16(p + d));
#endif
  for (; d < D; ++d) buf[d] = static_cast<float>(c10::Float8_e4m3fn(p[d], c10::Float8_e4m3fn::from_bits()));
  return buf;
}

static inline const float* kv_row(const c10::Half* p, float* buf, int64_t D) {
  int64_t d = 0;
#if defined(EDGELLM_V16)
  for (; d + 16 <= D; d += 16) v16_store(buf + d, load16(p + d));
#endif
  for (; d < D; ++d) buf[d] = static_cast<float>(p[d]);
  return buf;
}

// y[0, n) = x[0, n) as fp16, rounded to nearest even (torch's .to(float16); F16C where built in).
static inline void to_half(const float* x, c10::Half* y, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(EDGELLM_V16)
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < n; ++d) y[d] = c10::Half(x[d]);
}

#if defined(EDGELLM_V16)
// exp(v), v clamped to [-87.3, 88.3]: range reduction by ln 2 (Cody-Waite), a degree-6 Taylor
// polynomial on |r| <= ln2 / 2 and p * 2^k: within 2 ulp of expf.
static inline V16 exp16(V16 v) {
  const V16 log2e = v16_set1(1.44269504088896341f), ln2hi = v16_set1(0.693359375f);
  const V16 ln2lo = v16_set1(-2.12194440e-4f), one = v16_set1(1.f);
  v = v16_min(v16_max(v, v16_set1(-87.3f)), v16_set1(88.3f));
  const V16 k = v16_round(v16_mul(v, log2e));
  V16 r = v16_fnmadd(k, ln2hi, v);
  r = v16_fnmadd(k, ln2lo, r);
  V16 p = v16_fmadd(v16_set1(1.f / 720), r, v16_set1(1.f / 120));
  p = v16_fmadd(p, r, v16_set1(1.f / 24));
  p = v16_fmadd(p, r, v16_set1(1.f / 6));
  p = v16_fmadd(p, r, v16_set1(1.f / 2));
  p = v16_fmadd(p, r, one);
  p = v16_fmadd(p, r, one);
  return v16_times_pow2(p, k);
}
#endif

// x[i] = exp(x[i] - mx) for i < n (every x[i] <= mx), returning their sum (exp16 where built in;
// elsewhere std::exp).
static inline float exp_shifted_sum(float* x, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(EDGELLM_V16)
  const V16 vmx = v16_set1(mx);
  V16 vsum = v16_zero();
  for (; i + 16 <= n; i += 16) {
    const V16 e = exp16(v16_sub(v16_load(x + i), vmx));
    v16_store(x + i, e);
    vsum = v16_add(vsum, e);
  }
  sum = v16_sum(vsum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

// out[g] = q_g . k for the G query heads sharing one K row (q_g = q + g * D): k read once.
static inline void dots(const float* q, const float* k, int64_t D, int64_t G, float* out) {
#if defined(EDGELLM_V16)
  if (G <= 8 && D % 16 == 0) {
    V16 acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = v16_zero();
    for (int64_t d = 0; d < D; d += 16) {
      const V16 kv = v16_load(k + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = v16_fmadd(v16_load(q + g * D + d), kv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) out[g] = v16_sum(acc[g]);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) out[g] = dot(q + g * D, k, D);
}

// acc_g += p[g] * v for the G heads sharing one V row (acc_g = acc + g * D): v read once.
static inline void axpys(float* acc, const float* p, int64_t pstride, const float* v, int64_t D, int64_t G) {
#if defined(EDGELLM_V16)
  if (D % 16 == 0) {
    for (int64_t d = 0; d < D; d += 16) {
      const V16 vv = v16_load(v + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        v16_store(a, v16_fmadd(v16_set1(p[g * pstride]), vv, v16_load(a)));
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
#elif defined(EDGELLM_V16)
// Lane i of the result = the sum of x[i]'s 8 lanes (two rounds of hadd, one cross-half add).
static inline __m256 hsum8x8(const __m256* x) {
  const __m256 t0 = _mm256_hadd_ps(x[0], x[1]), t1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 t2 = _mm256_hadd_ps(x[4], x[5]), t3 = _mm256_hadd_ps(x[6], x[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves: partial sums of x[0..3], x[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane t of the result = the sum of v[t]'s 16 lanes.
static inline V16 hsum16(const V16* v) {
  __m256 w[16];
  for (int t = 0; t < 16; ++t) w[t] = _mm256_add_ps(v[t].lo, v[t].hi);
  return {hsum8x8(w), hsum8x8(w + 8)};
}
#endif

}  // namespace edgellm::cpu
