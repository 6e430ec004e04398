// The arithmetic of cascade_attention.cpp, two ways behind one interface: Bf16Math (bf16 operands
// and probabilities, fp32 sums: vdpbf16ps where built in) and F32Math (fp32 throughout: FMA on 16
// lanes, one zmm or two ymm). Each names its Word, PACK elements of a row packed in one Word, and:
//   key(k, D, kp, NP, j)    key row k (D floats) into column j of kp [D / PACK][NP]
//   value(v, D, vp, j)      value row j into vp [NP / PACK][D]
//   row(x, n, out)          a query row (n = D) or a row of probabilities (n even) into n / PACK words
//   scores(q, rows, D, kp, NP, s, ldS, scale)   s[r][n] = scale * q_r . k_n, n < NP (a multiple of 16)
//   values<DC>(p, ldP, rows, keys, vp, acc)     acc[r] += sum_{n < keys} p_r[n] v_n (keys rounded up to PACK)
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace edgellm::cpu::cascade {

constexpr int64_t KT = 16;  // keys per score vector

// dst[i] = bf16(src[i]), rounded to nearest even (vcvtneps2bf16 where built in)
inline void to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

inline float bf16_lo(uint32_t p) {
  const uint32_t b = p << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float bf16_hi(uint32_t p) { return bf16_lo(p >> 16); }

struct Bf16Math {
  using Word = uint32_t;  // two bf16: dims (2 i, 2 i + 1) of a row, or keys (2 i, 2 i + 1) of a dim
  static constexpr int64_t PACK = 2;

  static void row(const float* x, int64_t n, Word* out) { to_bf16(x, reinterpret_cast<c10::BFloat16*>(out), n); }
  static void key(const float* k, int64_t D, Word* kp, int64_t NP, int64_t j) {
    Word pairs[128];
    row(k, D, pairs);
    for (int64_t dp = 0; dp < D / 2; ++dp) kp[dp * NP + j] = pairs[dp];
  }
  static void value(const float* v, int64_t D, Word* vp, int64_t j) {
    alignas(64) c10::BFloat16 b[256];
    to_bf16(v, b, D);
    Word* out = vp + j / 2 * D;
    const int shift = j % 2 ? 16 : 0;
    for (int64_t d = 0; d < D; ++d) out[d] |= static_cast<Word>(b[d].x) << shift;
  }

#if defined(__AVX512BF16__)
  template <int R, int T>
  static void tile(const Word* q, int64_t D2, const Word* kp, int64_t NP, int64_t j0, float* s, int64_t ldS,
                   float scale) {
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D2; ++dp) {
      __m512bh kv[T];
      for (int t = 0; t < T; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(kp + dp * NP + (j0 + t) * KT);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D2 + dp]));
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qv, kv[t]);
      }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) _mm512_storeu_ps(s + r * ldS + (j0 + t) * KT, _mm512_mul_ps(acc[r][t], sv));
  }
  template <int R>
  static void tiles(const Word* q, int64_t D2, const Word* kp, int64_t NP, float* s, int64_t ldS, float scale) {
    int64_t j = 0;
    for (; j + 4 <= NP / KT; j += 4) tile<R, 4>(q, D2, kp, NP, j, s, ldS, scale);
    for (; j < NP / KT; ++j) tile<R, 1>(q, D2, kp, NP, j, s, ldS, scale);
  }
  // rows [0, R) of acc, dims [16 c0, 16 (c0 + CB)): R x CB accumulators beside CB value vectors
  template <int CB, int R>
  static void pv(const Word* p, int64_t ldP, int64_t n2s, const Word* vp, int64_t D, int64_t c0, float* acc) {
    __m512 a[R][CB];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * (c0 + c));
    for (int64_t n2 = 0; n2 < n2s; ++n2) {
      __m512bh vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + n2 * D + 16 * (c0 + c));
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * ldP + n2]));
        for (int c = 0; c < CB; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + r * D + 16 * (c0 + c), a[r][c]);
  }
#endif

  static void scores(const Word* q, int64_t rows, int64_t D, const Word* kp, int64_t NP, float* s, int64_t ldS,
                     float scale) {
    const int64_t D2 = D / 2;
#if defined(__AVX512BF16__)
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) tiles<4>(q + r * D2, D2, kp, NP, s + r * ldS, ldS, scale);
    for (; r < rows; ++r) tiles<1>(q + r * D2, D2, kp, NP, s + r * ldS, ldS, scale);
#else
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t n = 0; n < NP; ++n) {
        float acc = 0.f;
        for (int64_t dp = 0; dp < D2; ++dp) {
          const Word a = q[r * D2 + dp], b = kp[dp * NP + n];
          acc += bf16_lo(a) * bf16_lo(b) + bf16_hi(a) * bf16_hi(b);
        }
        s[r * ldS + n] = acc * scale;
      }
    }
#endif
  }
  template <int DC>
  static void values(const Word* p, int64_t ldP, int64_t rows, int64_t keys, const Word* vp, float* acc) {
    constexpr int64_t D = DC * 16;
    const int64_t n2s = (keys + 1) / 2;
#if defined(__AVX512BF16__)
    constexpr int CB = DC % 4 == 0 ? 4 : 2;  // 16-dim vectors per pass (DC is 4, 6, 8 or 16)
    for (int64_t c0 = 0; c0 < DC; c0 += CB) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) pv<CB, 4>(p + r * ldP, ldP, n2s, vp, D, c0, acc + r * D);
      for (; r < rows; ++r) pv<CB, 1>(p + r * ldP, ldP, n2s, vp, D, c0, acc + r * D);
    }
#else
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n2 = 0; n2 < n2s; ++n2)
        for (int64_t d = 0; d < D; ++d) {
          const Word pp = p[r * ldP + n2], vv = vp[n2 * D + d];
          acc[r * D + d] += bf16_lo(pp) * bf16_lo(vv) + bf16_hi(pp) * bf16_hi(vv);
        }
#endif
  }
};

struct F32Math {
  using Word = float;
  static constexpr int64_t PACK = 1;

  static void row(const float* x, int64_t n, Word* out) { std::memcpy(out, x, n * sizeof(float)); }
  static void key(const float* k, int64_t D, Word* kp, int64_t NP, int64_t j) {
    for (int64_t d = 0; d < D; ++d) kp[d * NP + j] = k[d];
  }
  static void value(const float* v, int64_t D, Word* vp, int64_t j) { row(v, D, vp + j * D); }

#if defined(EDGELLM_V16)
#if defined(__AVX512F__)
  static constexpr int RS = 4, TS = 4;  // score micro-tile: rows x 16-key vectors (zmm registers)
#else
  static constexpr int RS = 2, TS = 2;  // two ymm per vector: 8 accumulators of the 16 registers
#endif
  template <int R, int T>
  static void tile(const float* q, int64_t D, const float* kp, int64_t NP, int64_t j0, float* s, int64_t ldS,
                   float scale) {
    V16 acc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = v16_zero();
    for (int64_t d = 0; d < D; ++d) {
      V16 kv[T];
      for (int t = 0; t < T; ++t) kv[t] = v16_load(kp + d * NP + (j0 + t) * KT);
      for (int r = 0; r < R; ++r) {
        const V16 qd = v16_set1(q[r * D + d]);
        for (int t = 0; t < T; ++t) acc[r][t] = v16_fmadd(qd, kv[t], acc[r][t]);
      }
    }
    const V16 sv = v16_set1(scale);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) v16_store(s + r * ldS + (j0 + t) * KT, v16_mul(acc[r][t], sv));
  }
  template <int R>
  static void tiles(const float* q, int64_t D, const float* kp, int64_t NP, float* s, int64_t ldS, float scale) {
    int64_t j = 0;
    for (; j + TS <= NP / KT; j += TS) tile<R, TS>(q, D, kp, NP, j, s, ldS, scale);
    for (; j < NP / KT; ++j) tile<R, 1>(q, D, kp, NP, j, s, ldS, scale);
  }
  template <int CB, int R>
  static void pv(const float* p, int64_t ldP, int64_t keys, const float* vp, int64_t D, int64_t c0, float* acc) {
    V16 a[R][CB];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) a[r][c] = v16_load(acc + r * D + 16 * (c0 + c));
    for (int64_t n = 0; n < keys; ++n) {
      V16 vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = v16_load(vp + n * D + 16 * (c0 + c));
      for (int r = 0; r < R; ++r) {
        const V16 pn = v16_set1(p[r * ldP + n]);
        for (int c = 0; c < CB; ++c) a[r][c] = v16_fmadd(pn, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) v16_store(acc + r * D + 16 * (c0 + c), a[r][c]);
  }
#endif

  static void scores(const float* q, int64_t rows, int64_t D, const float* kp, int64_t NP, float* s, int64_t ldS,
                     float scale) {
#if defined(EDGELLM_V16)
    int64_t r = 0;
    for (; r + RS <= rows; r += RS) tiles<RS>(q + r * D, D, kp, NP, s + r * ldS, ldS, scale);
    for (; r < rows; ++r) tiles<1>(q + r * D, D, kp, NP, s + r * ldS, ldS, scale);
#else
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < NP; ++n) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * kp[d * NP + n];
        s[r * ldS + n] = acc * scale;
      }
#endif
  }
  template <int DC>
  static void values(const float* p, int64_t ldP, int64_t rows, int64_t keys, const float* vp, float* acc) {
    constexpr int64_t D = DC * 16;
#if defined(EDGELLM_V16)
#if defined(__AVX512F__)
    constexpr int CB = DC % 4 == 0 ? 4 : 2, R = 4;  // 4 CB zmm accumulators beside CB value vectors
#else
    constexpr int CB = 2, R = 2;  // two ymm per vector: 8 accumulators, 4 values, 2 broadcast
#endif
    for (int64_t c0 = 0; c0 < DC; c0 += CB) {
      int64_t r = 0;
      for (; r + R <= rows; r += R) pv<CB, R>(p + r * ldP, ldP, keys, vp, D, c0, acc + r * D);
      for (; r < rows; ++r) pv<CB, 1>(p + r * ldP, ldP, keys, vp, D, c0, acc + r * D);
    }
#else
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < keys; ++n)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += p[r * ldP + n] * vp[n * D + d];
#endif
  }
};

}  // namespace edgellm::cpu::cascade
