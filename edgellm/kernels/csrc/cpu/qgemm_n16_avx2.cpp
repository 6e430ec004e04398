// The n16 integer-dot tiles on AVX2 without VNNI (the contract: qgemm_n16.h; built for CPUs with
// AVX2 and no vpdpbusd: AMD Zen 2/3, Intel Haswell to Comet Lake, and AVX-512 CPUs without VNNI).
//
// The sums of qgemm_n16_ymm.cpp with vpdpbusd's work done by vpmaddubsw (pairs of u8 x s8 into
// s16) and vpmaddwd (pairs of s16 into int32). A tile's 16 outputs are two halves of 8 int32
// lanes; each layout row's codes are loaded (int4: unpacked by a mask, or a shift and a mask) once
// per block and half and shared by the activation rows of the pass, each row taking 4 activation
// bytes broadcast to every lane:
//   int4 (codes 0..15): the eight layout rows' vpmaddubsw products are added in 16 bits (each
//     lane at most 8 * 2 * 15 * 127 = 30480 < 2^15, so no saturation), then one vpmaddwd per
//     block and row gives the block's int32 sums;
//   int8 (stored code + 128): the code is taken back to signed by flipping its top bit, and the
//     sign trick makes vpmaddubsw's operands |w| and sign(a, w) (each pair at most
//     2 * 128 * 127 = 32512), one vpmaddwd per layout row;
//   5/6-bit (stored code + 16 / + 32, so 0..63): the stored codes times the activations, two
//     layout rows added in 16 bits (each lane at most 2 * 2 * 63 * 127 = 32004 < 2^15), one
//     vpmaddwd per two rows, into int32 sums that start at -n16_zero(bits) * (the activations'
//     code sum).
// Each block's int32 sums are converted and scaled by one FMA (groups of 16: two); offsets add
// offset * dsum per group; the last tile's rows past N are masked out of the store.
#include "qgemm_n16.h"

#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#include "qgemm_n16_ymm_parts.h"

namespace edgellm::cpu {
namespace {

using ymm::bcast4;
using ymm::HALF;
using ymm::load8;

constexpr int MR = 4;  // activation rows sharing one pass over a half tile's codes

// Keeps v in a register at this point: without it the compiler reassociates a block's sums into a
// tree whose products (32 of them for 4 rows) no longer fit the 16 ymm registers and spill.
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// Outputs 16 t + 8 h .. 16 t + 8 (h + H) - 1 of tile t (H halves in one pass) for activation rows
// m0 .. m0 + R.
template <int BITS, int R, int H, typename S>
void half_rows(const N16Weights<S>& w, int64_t t, int64_t h, const QActs& x, int64_t m0, float* y,
               const float* bias) {
  const uint8_t* base = w.q + t * w.tile_bytes() + h * 32;
  const GroupScales<S> scales = w.scales(t);
  const int8_t* xa[R];
  for (int m = 0; m < R; ++m) xa[m] = x.a + (m0 + m) * x.K;
  __m256 acc[H][R];
  for (int j = 0; j < H; ++j)
    for (int m = 0; m < R; ++m) acc[j][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  // int8: the signed codes of layout row r for half j of block p
  auto codes8 = [&](const uint8_t* p, int j, int r) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * r + 32 * j)), top);
  };
  // 5/6 bits: add layout rows r and r + 1's products (half j, block p) for the R rows into s[m]
  auto dot_narrow = [&](__m256i* s, const uint8_t* p, int j, int r, int64_t col) {
    const __m256i c0 = ymm::codes_ymm<BITS>(p, j, r), c1 = ymm::codes_ymm<BITS>(p, j, r + 1);
    for (int m = 0; m < R; ++m) {
      const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(xa[m] + col)),
                                           _mm256_maddubs_epi16(c1, bcast4(xa[m] + col + 4)));
      s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(p16, ones));
      in_register(s[m]);
    }
  };
  const int32_t Z = w.zero;
  const int32_t* isum = x.isum + m0 * 2 * x.nb;  // row m's half-block sums: isum + m * 2 * nb
  // int8: add layout row r's products for the R rows into s[m] (int32)
  auto dot8 = [&](__m256i* s, const __m256i c, int64_t col) {
    const __m256i mag = _mm256_sign_epi8(c, c);
    for (int m = 0; m < R; ++m) {
      const __m256i p16 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(bcast4(xa[m] + col), c));
      s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(p16, ones));
      in_register(s[m]);
    }
  };
  __m256 sv[H];
  for (int j = 0; j < H; ++j) sv[j] = _mm256_setzero_ps();
  for (int64_t b = 0, left = 0, g = 0; b < w.nb; ++b) {
    const uint8_t* p = base + b * w.block_bytes;
    prefetch_ahead(p, w.block_bytes);
    if constexpr (BITS != 4) {
      if (w.bpg == 0) {  // groups of 16: each half block (layout rows 0-3, 4-7) has its own scales
        for (int j = 0; j < H; ++j) {
          const __m256 s_lo = load8(scales, 2 * b, (h + j) * HALF), s_hi = load8(scales, 2 * b + 1, (h + j) * HALF);
          __m256i lo[R], hi[R];
          for (int m = 0; m < R; ++m) {  // int8's sign trick needs no start
            lo[m] = _mm256_set1_epi32(BITS == 8 ? 0 : -Z * isum[m * 2 * x.nb + 2 * b]);
            hi[m] = _mm256_set1_epi32(BITS == 8 ? 0 : -Z * isum[m * 2 * x.nb + 2 * b + 1]);
          }
          if constexpr (BITS == 8) {
            for (int r = 0; r < 4; ++r) {
              dot8(lo, codes8(p, j, r), b * QB + 4 * r);
              dot8(hi, codes8(p, j, r + 4), b * QB + 16 + 4 * r);
            }
          } else {
            for (int r = 0; r < 4; r += 2) {
              dot_narrow(lo, p, j, r, b * QB + 4 * r);
              dot_narrow(hi, p, j, r + 4, b * QB + 16 + 4 * r);
            }
          }
          for (int m = 0; m < R; ++m) {
            const __m256 dm = _mm256_set1_ps(x.d[(m0 + m) * x.nb + b]);
            acc[j][m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo[m]), s_lo), dm, acc[j][m]);
            acc[j][m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi[m]), s_hi), dm, acc[j][m]);
          }
        }
        continue;
      }
    }
    if (left-- == 0) {  // the first block of group g
      for (int j = 0; j < H; ++j) sv[j] = load8(scales, g, (h + j) * HALF);
      ++g;
      left = w.bpg - 1;
    }
    __m256i s[H][R];
    for (int j = 0; j < H; ++j) {
      if constexpr (BITS == 4) {
        for (int m = 0; m < R; ++m) s[j][m] = _mm256_setzero_si256();  // 16-bit sums
        for (int r = 0; r < 4; ++r) {  // one load: layout rows r (low nibbles) and r + 4 (high)
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * r + 32 * j));
          const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          for (int m = 0; m < R; ++m) {
            const int8_t* a = xa[m] + b * QB + 4 * r;
            s[j][m] = _mm256_add_epi16(s[j][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(a)),
                                                                 _mm256_maddubs_epi16(hi, bcast4(a + 16))));
            in_register(s[j][m]);
          }
        }
        for (int m = 0; m < R; ++m) {
          s[j][m] = _mm256_madd_epi16(s[j][m], ones);
          if (Z != 0)  // symmetric int4: codes stored + 8
            s[j][m] = _mm256_sub_epi32(s[j][m], _mm256_set1_epi32(Z * (isum[m * 2 * x.nb + 2 * b] + isum[m * 2 * x.nb + 2 * b + 1])));
        }
      } else if constexpr (BITS == 8) {
        for (int m = 0; m < R; ++m) s[j][m] = _mm256_setzero_si256();
        for (int r = 0; r < 8; ++r) dot8(s[j], codes8(p, j, r), b * QB + 4 * r);
      } else {
        for (int m = 0; m < R; ++m)
          s[j][m] = _mm256_set1_epi32(-Z * (isum[m * 2 * x.nb + 2 * b] + isum[m * 2 * x.nb + 2 * b + 1]));
        for (int r = 0; r < 8; r += 2) dot_narrow(s[j], p, j, r, b * QB + 4 * r);
      }
    }
    for (int m = 0; m < R; ++m) {
      const __m256 dm = _mm256_set1_ps(x.d[(m0 + m) * x.nb + b]);
      for (int j = 0; j < H; ++j)
        acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j][m]), _mm256_mul_ps(sv[j], dm), acc[j][m]);
    }
  }
  ymm::finish<R, H>(w, t, h, x, m0, acc, y, bias);
}

// Rows [m0, m0 + left) (left < MR) of tile t: one row over both halves in one pass (its
// activation broadcasts shared), more one half at a time (both halves' sums would spill).
template <int BITS, typename S, int R = MR - 1>
void rest_rows(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, int64_t left, float* y,
               const float* bias) {
  if constexpr (R == 1) {
    half_rows<BITS, 1, 2>(w, t, 0, x, m0, y, bias);
  } else if constexpr (R > 1) {
    if (left != R) return rest_rows<BITS, S, R - 1>(w, t, x, m0, left, y, bias);
    for (int64_t h = 0; h < 2 && t * N16 + h * HALF < w.N; ++h) half_rows<BITS, R, 1>(w, t, h, x, m0, y, bias);
  }
}

}  // namespace

template <int BITS, typename S>
void n16_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y,
               const float* bias) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
      for (int64_t h = 0; h < 2 && t * N16 + h * HALF < w.N; ++h) half_rows<BITS, MR, 1>(w, t, h, x, m, y, bias);
    if (m < M) rest_rows<BITS, S>(w, t, x, m, M - m, y, bias);
  }
}

EDGELLM_N16_INSTANTIATE(n16_tiles)

}  // namespace edgellm::cpu
#endif
