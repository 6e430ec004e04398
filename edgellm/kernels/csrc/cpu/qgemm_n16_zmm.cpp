// The n16 integer-dot tiles on AVX-512 VNNI (the contract: qgemm_n16.h; built for levels avx512 + vnni
// and amx): a tile's 16 outputs are the 16 int32 lanes of one zmm; each layout row r of a 32-column
// block adds vpdpbusd(codes_r, the activation row's 4 bytes of columns 4 r .. 4 r + 3 broadcast)
// into an int32 sum that starts at -n16_zero(bits) * (the activations' code sum) (undoing the
// stored + 128 of int8, + 16 / + 32 of 5 / 6-bit codes), so the block dot is exact. It is converted and scaled by one FMA per block (scale per
// output lane times the block's step); offsets add offset * dsum per group. No horizontal sums:
// the lanes are the outputs. Two loop orders, the same sums in the same order (so bit-equal):
// - up to MR rows (decode): tile by tile, a block's 8 layout rows loaded (int4: 4 loads, one mask
//   and one shift) and shared by the rows, whose fp32 sums stay in registers;
// - more rows (prefill, wide decode batches): two tiles at a time, a block's codes of both
//   unpacked into 16 registers once and run against every row of a chunk of up to WIDE_CHUNK rows,
//   WR rows at a time (2 * WR independent vpdpbusd chains, enough to cover its latency), with the
//   fp32 sums of the chunk in an L1 buffer. The codes are unpacked once per chunk, not once per
//   MR rows, and each activation broadcast feeds two tiles.
// Work is split over torch's threads by tiles.
#include "qgemm_n16.h"

#if defined(__AVX512VNNI__)
#include <immintrin.h>

#include "qgemm_n16_zmm_codes.h"
#include "qgemm_n16_zmm_scales.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace edgellm::cpu {
namespace {

inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The end of R rows' fp32 sums v of one tile (both loop orders): + offset * dsum per group (each
// group's offsets loaded once for the R rows), + bias, the store of the outputs below N. y: the
// tile's first column of row m0, rows ldy apart.
template <int R, typename S>
inline void finish_rows(const QActs& x, int64_t m0, __m512 (&v)[R], const GroupScales<S>& offs, int64_t G, float* y,
                        int64_t ldy, __mmask16 mask, __m512 bv) {
  if (offs.v != nullptr) {
    for (int64_t g = 0; g < G; ++g) {
      const __m512 ov = load16(offs, g);
      for (int u = 0; u < R; ++u) v[u] = _mm512_fmadd_ps(ov, _mm512_set1_ps(x.dsum[(m0 + u) * x.G + g]), v[u]);
    }
  }
  for (int u = 0; u < R; ++u) _mm512_mask_storeu_ps(y + (m0 + u) * ldy, mask, _mm512_add_ps(v[u], bv));
}

// Outputs of tile t for activation rows m0 .. m0 + MR.
template <int BITS, int MR, typename S>
void vnni_rows(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, float* y, int64_t ldy,
               const float* bias) {
  const uint8_t* base = w.q + t * w.tile_bytes();
  const GroupScales<S> scales = w.scales(t);
  const int8_t* xa[MR];
  const float* xd[MR];
  const int32_t* xs[MR];
  for (int m = 0; m < MR; ++m) {
    xa[m] = x.a + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * x.nb;
    xs[m] = x.isum + (m0 + m) * 2 * x.nb;
  }
  const int32_t Z = w.zero;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  __m512 sv = _mm512_setzero_ps();
  for (int64_t b = 0, left = 0, g = 0; b < w.nb; ++b) {
    const uint8_t* p = base + b * w.block_bytes;
    prefetch_ahead(p, w.block_bytes);
    __m512i wv[8];
    unpack_codes_zmm<BITS>(p, wv);
    if (w.bpg == 0) {  // groups of 16 (int8 / narrow codes): each half block has its own scales
      const __m512 s_lo = load16(scales, 2 * b), s_hi = load16(scales, 2 * b + 1);
      for (int m = 0; m < MR; ++m) {
        const int8_t* a = xa[m] + b * QB;
        __m512i lo = _mm512_set1_epi32(-Z * xs[m][2 * b]), hi = _mm512_set1_epi32(-Z * xs[m][2 * b + 1]);
        for (int r = 0; r < 4; ++r) {
          lo = _mm512_dpbusd_epi32(lo, wv[r], bcast4(a + 4 * r));
          hi = _mm512_dpbusd_epi32(hi, wv[r + 4], bcast4(a + 16 + 4 * r));
        }
        const __m512 dm = _mm512_set1_ps(xd[m][b]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), s_lo), dm, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), s_hi), dm, acc[m]);
      }
      continue;
    }
    if (left-- == 0) {  // the first block of group g
      sv = load16(scales, g++);
      left = w.bpg - 1;
    }
    for (int m = 0; m < MR; ++m) {
      const int8_t* a = xa[m] + b * QB;
      __m512i s = Z != 0 ? _mm512_set1_epi32(-Z * (xs[m][2 * b] + xs[m][2 * b + 1])) : _mm512_setzero_si512();
      for (int r = 0; r < 8; ++r) s = _mm512_dpbusd_epi32(s, wv[r], bcast4(a + 4 * r));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_set1_ps(xd[m][b])), acc[m]);
    }
  }
  const int64_t n0 = t * N16, valid = std::min<int64_t>(N16, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  finish_rows<MR>(x, m0, acc, w.offsets(t), w.G, y + n0, ldy, mask, bv);
}

constexpr int MR = 8;  // activation rows sharing one pass over a tile's loaded codes

template <int BITS, typename S, int R = MR>
void vnni_rest(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, int64_t left, float* y,
               const float* bias) {
  if constexpr (R > 0) {
    if (left == R) return vnni_rows<BITS, R>(w, t, x, m0, y, w.N, bias);
    return vnni_rest<BITS, S, R - 1>(w, t, x, m0, left, y, bias);
  }
}

// Many rows. The fp32 sums of rows m0 .. m0 + R (R <= WR) of a block: the int32 dots of the
// block's codes wv of NT2 tiles against each row, converted and scaled into acc [rows, NT2 * 16].
template <int BITS, int NT2, int R>
inline void wide_block(const __m512i (&wv)[NT2][8], const __m512 (&sv)[NT2], const QActs& x, int64_t m0,
                       int64_t b, float* acc, int32_t Z) {
  __m512i s[R][NT2];
  for (int m = 0; m < R; ++m) {
    const int32_t* is = x.isum + (m0 + m) * 2 * x.nb + 2 * b;
    const __m512i s0 = Z != 0 ? _mm512_set1_epi32(-Z * (is[0] + is[1])) : _mm512_setzero_si512();
    for (int j = 0; j < NT2; ++j) s[m][j] = s0;
  }
  for (int r = 0; r < 8; ++r) {
    for (int m = 0; m < R; ++m) {
      const __m512i bc = bcast4(x.a + (m0 + m) * x.K + b * QB + 4 * r);
      for (int j = 0; j < NT2; ++j) s[m][j] = _mm512_dpbusd_epi32(s[m][j], wv[j][r], bc);
    }
  }
  for (int m = 0; m < R; ++m) {
    const __m512 dm = _mm512_set1_ps(x.d[(m0 + m) * x.nb + b]);
    for (int j = 0; j < NT2; ++j) {
      float* o = acc + (m * NT2 + j) * N16;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][j]), _mm512_mul_ps(sv[j], dm), _mm512_loadu_ps(o)));
    }
  }
}

constexpr int WR = 4;                // rows of one pass over a block's unpacked codes
constexpr int64_t WIDE_CHUNK = 64;   // rows whose fp32 sums share the L1 buffer (8 KB)

template <int BITS, int NT2, typename S, int R = WR - 1>
void wide_rest(const __m512i (&wv)[NT2][8], const __m512 (&sv)[NT2], const QActs& x, int64_t m0, int64_t left,
               int64_t b, float* acc, int32_t Z) {
  if constexpr (R > 0) {
    if (left == R) return wide_block<BITS, NT2, R>(wv, sv, x, m0, b, acc, Z);
    return wide_rest<BITS, NT2, S, R - 1>(wv, sv, x, m0, left, b, acc, Z);
  }
}

// finish_rows for R rows of the L1 buffer: acc, the first row's 16 sums, rows `stride` floats apart.
template <int R, typename S>
inline void wide_finish(const QActs& x, int64_t m0, const float* acc, int64_t stride, const GroupScales<S>& offs,
                        int64_t G, float* y, int64_t ldy, __mmask16 mask, __m512 bv) {
  __m512 v[R];
  for (int u = 0; u < R; ++u) v[u] = _mm512_loadu_ps(acc + u * stride);
  finish_rows<R>(x, m0, v, offs, G, y, ldy, mask, bv);
}

// Outputs of tiles t .. t + NT2 for rows m0 .. m0 + rows (rows <= WIDE_CHUNK, group >= 32).
template <int BITS, int NT2, typename S>
void wide_tiles(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, int64_t rows, float* y,
                const float* bias, float* acc) {
  std::fill(acc, acc + rows * NT2 * N16, 0.f);
  __m512 sv[NT2];
  for (int64_t b = 0, left = 0, g = 0; b < w.nb; ++b) {
    __m512i wv[NT2][8];
    for (int j = 0; j < NT2; ++j) {
      const uint8_t* p = w.q + (t + j) * w.tile_bytes() + b * w.block_bytes;
      prefetch_ahead(p, w.block_bytes);
      unpack_codes_zmm<BITS>(p, wv[j]);
    }
    if (left-- == 0) {  // the first block of group g
      for (int j = 0; j < NT2; ++j) sv[j] = load16(w.scales(t + j), g);
      ++g;
      left = w.bpg - 1;
    }
    int64_t m = 0;
    for (; m + WR <= rows; m += WR) wide_block<BITS, NT2, WR>(wv, sv, x, m0 + m, b, acc + m * NT2 * N16, w.zero);
    if (m < rows) wide_rest<BITS, NT2, S>(wv, sv, x, m0 + m, rows - m, b, acc + m * NT2 * N16, w.zero);
  }
  for (int j = 0; j < NT2; ++j) {
    const int64_t n0 = (t + j) * N16, valid = std::min<int64_t>(N16, w.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const GroupScales<S> offs = w.offsets(t + j);
    int64_t m = 0;
    for (; m + WR <= rows; m += WR) wide_finish<WR>(x, m0 + m, acc + (m * NT2 + j) * N16, NT2 * N16, offs, w.G, y + n0,
                                                    w.N, mask, bv);
    for (; m < rows; ++m) wide_finish<1>(x, m0 + m, acc + (m * NT2 + j) * N16, NT2 * N16, offs, w.G, y + n0, w.N,
                                         mask, bv);
  }
}

// Tiles [t0, t1), all M rows, in the many-rows order.
template <int BITS, typename S>
void wide(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y, const float* bias) {
  thread_local std::vector<float> acc(WIDE_CHUNK * 2 * N16);
  for (int64_t t = t0; t < t1; t += 2) {
    for (int64_t m = 0; m < M; m += WIDE_CHUNK) {
      const int64_t rows = std::min(WIDE_CHUNK, M - m);
      if (t + 2 <= t1) {
        wide_tiles<BITS, 2>(w, t, x, m, rows, y, bias, acc.data());
      } else {
        wide_tiles<BITS, 1>(w, t, x, m, rows, y, bias, acc.data());
      }
    }
  }
}

}  // namespace

template <int BITS, typename S>
void n16_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y, const float* bias) {
  if (M > MR && w.bpg > 0) return wide<BITS, S>(w, t0, t1, x, M, y, bias);
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) vnni_rows<BITS, MR>(w, t, x, m, y, w.N, bias);
    if (m < M) vnni_rest<BITS>(w, t, x, m, M - m, y, bias);
  }
}

EDGELLM_N16_INSTANTIATE(n16_tiles)

}  // namespace edgellm::cpu
#endif
