// The n16 integer-dot tiles on AVX-VNNI, 256 bits (the contract: qgemm_n16.h; built for level avx2
// on CPUs with AVX-VNNI and no AVX-512 VNNI: Intel client cores since Alder Lake, AMD Zen 5 capped
// to avx2).
//
// The same sums as qgemm_n16_zmm.cpp with a tile's 16 outputs in two halves of 8 int32 lanes (one
// ymm each): each layout row's 64 bytes are the 4 codes of outputs 0..7 (bytes 0..31) then of
// outputs 8..15, so a half reads its 32 bytes of every row. Each layout row's codes are loaded
// (int4: unpacked with one mask, or a shift and a mask) once per block and half and shared by the
// activation rows of the pass: MR rows over one half at a time, or the last few rows over both
// halves at once, so the int32 sums and fp32 accumulators stay within AVX2's 16 registers. Each
// row adds vpdpbusd(codes_r, 4 activation bytes broadcast) into an int32 sum that starts at
// -n16_zero(bits) * (the activations' code sum) (int8 and narrow codes), converted and scaled by one FMA per block; offsets add
// offset * dsum per group; the last tile's rows past N are masked out of the store.
#include "qgemm_n16.h"

#if defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
#include "qgemm_n16_ymm_parts.h"

namespace edgellm::cpu {
namespace {

using ymm::bcast4;
using ymm::HALF;
using ymm::load8;

constexpr int MR = 4;  // activation rows sharing one pass over a half tile's codes


// Outputs 16 t + 8 h .. 16 t + 8 (h + H) - 1 of tile t (H halves in one pass) for activation rows
// m0 .. m0 + R. The codes are loaded and unpacked once per block and half, as they are used.
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
  const int32_t Z = w.zero;
  auto codes = [](const uint8_t* p, int j, int r) { return ymm::codes_ymm<BITS>(p, j, r); };
  __m256 sv[H];
  for (int j = 0; j < H; ++j) sv[j] = _mm256_setzero_ps();
  for (int64_t b = 0, left = 0, g = 0; b < w.nb; ++b) {
    const uint8_t* p = base + b * w.block_bytes;
    prefetch_ahead(p, w.block_bytes);
    if (w.bpg == 0) {  // groups of 16 (int8 / narrow codes): each half block has its own scales
      for (int j = 0; j < H; ++j) {
        const __m256 s_lo = load8(scales, 2 * b, (h + j) * HALF), s_hi = load8(scales, 2 * b + 1, (h + j) * HALF);
        __m256i lo[R], hi[R];
        for (int m = 0; m < R; ++m) {
          const int32_t* is = x.isum + (m0 + m) * 2 * x.nb + 2 * b;
          lo[m] = _mm256_set1_epi32(-Z * is[0]);
          hi[m] = _mm256_set1_epi32(-Z * is[1]);
        }
        for (int r = 0; r < 4; ++r) {
          const __m256i c_lo = codes(p, j, r), c_hi = codes(p, j, r + 4);
          for (int m = 0; m < R; ++m) {
            lo[m] = _mm256_dpbusd_avx_epi32(lo[m], c_lo, bcast4(xa[m] + b * QB + 4 * r));
            hi[m] = _mm256_dpbusd_avx_epi32(hi[m], c_hi, bcast4(xa[m] + b * QB + 16 + 4 * r));
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
    if (left-- == 0) {  // the first block of group g
      for (int j = 0; j < H; ++j) sv[j] = load8(scales, g, (h + j) * HALF);
      ++g;
      left = w.bpg - 1;
    }
    __m256i s[H][R];
    for (int m = 0; m < R; ++m) {
      __m256i start = _mm256_setzero_si256();
      if (Z != 0) {
        const int32_t* is = x.isum + (m0 + m) * 2 * x.nb + 2 * b;
        start = _mm256_set1_epi32(-Z * (is[0] + is[1]));
      }
      for (int j = 0; j < H; ++j) s[j][m] = start;
    }
    for (int r = 0; r < 8; ++r) {
      for (int j = 0; j < H; ++j) {
        const __m256i c = codes(p, j, r);
        for (int m = 0; m < R; ++m) s[j][m] = _mm256_dpbusd_avx_epi32(s[j][m], c, bcast4(xa[m] + b * QB + 4 * r));
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

// Rows [m0, m0 + left) (left < MR) of tile t, both halves in one pass (few rows: the codes are
// unpacked once for both).
template <int BITS, typename S, int R = MR - 1>
void rest_rows(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, int64_t left, float* y,
               const float* bias) {
  if constexpr (R > 0) {
    if (left == R) return half_rows<BITS, R, 2>(w, t, 0, x, m0, y, bias);
    return rest_rows<BITS, S, R - 1>(w, t, x, m0, left, y, bias);
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
