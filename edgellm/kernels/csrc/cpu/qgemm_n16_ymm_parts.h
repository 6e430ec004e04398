// What the two 256-bit n16 tile files share (qgemm_n16_ymm.cpp on AVX-VNNI, qgemm_n16_avx2.cpp
// on AVX2 without it): a tile's 16 outputs as two halves of 8 fp32 lanes, the loads, and the
// end of a pass (offsets, bias, the masked store of the last tile's rows). Included only by
// builds with AVX2.
#pragma once

#include "qgemm_n16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace edgellm::cpu::ymm {

constexpr int64_t HALF = 8;  // outputs per ymm

// Outputs lane .. lane + 7 of group g's scales (or offsets) of a tile (the forms of qgemm_n16.h)
inline __m256 load8(const GroupScales<float>& s, int64_t g, int64_t lane) {
  return _mm256_loadu_ps(s.v + g * N16 + lane);
}
inline __m256 load8(const GroupScales<c10::Half>& s, int64_t g, int64_t lane) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.v + g * N16 + lane)));
}
inline __m256 load8(const GroupScales<int8_t>& s, int64_t g, int64_t lane) {
  const __m256i m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.v + g * N16 + lane)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_loadu_ps(s.base + g / s.gps * N16 + lane));
}
inline __m256i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// Layout row r's stored codes for half j (bytes 32 j .. 32 j + 31 of the row) of the block at p
// (qgemm_n16.h): int4 nibbles, int8 bytes, or the nibbles with bit 4 (and 5) from the planes, bit
// r of each plane byte shifted into place (a 16-bit shift by 4 - r or 5 - r: the bits it carries
// across a byte boundary land outside the mask).
template <int BITS>
inline __m256i codes_ymm(const uint8_t* p, int j, int r) {
  auto at = [&](int64_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off + 32 * j)); };
  if constexpr (BITS == 8) {
    return at(64 * r);
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0f), raw = at(64 * (r & 3));
    __m256i c = _mm256_and_si256(r < 4 ? raw : _mm256_srli_epi16(raw, 4), low4);
    auto plane_bit = [&](int64_t off, int bit) {  // bit `bit` of the codes from the plane at p + off
      const __m256i pl = at(off);
      const int sh = bit - r;
      const __m256i v = sh >= 0 ? _mm256_slli_epi16(pl, sh) : _mm256_srli_epi16(pl, -sh);
      return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(1 << bit)));
    };
    if constexpr (BITS >= 5) c = _mm256_or_si256(c, plane_bit(256, 4));
    if constexpr (BITS == 6) c = _mm256_or_si256(c, plane_bit(320, 5));
    return c;
  }
}

inline __m256i lane_mask(int64_t valid) {  // lanes [0, valid) all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The end of a pass over halves h .. h + H - 1 of tile t for activation rows m0 .. m0 + R, whose
// block sums are in acc: adds offset * dsum per group and the bias, and stores the outputs below N.
template <int R, int H, typename S>
inline void finish(const N16Weights<S>& w, int64_t t, int64_t h, const QActs& x, int64_t m0, __m256 (&acc)[H][R],
                   float* y, const float* bias) {
  const GroupScales<S> offs = w.offsets(t);
  if (offs.v != nullptr) {
    for (int64_t g = 0; g < w.G; ++g) {
      for (int j = 0; j < H; ++j) {
        const __m256 ov = load8(offs, g, (h + j) * HALF);
        for (int m = 0; m < R; ++m)
          acc[j][m] = _mm256_fmadd_ps(ov, _mm256_set1_ps(x.dsum[(m0 + m) * x.G + g]), acc[j][m]);
      }
    }
  }
  for (int j = 0; j < H; ++j) {
    const int64_t n0 = t * N16 + (h + j) * HALF, valid = std::min<int64_t>(HALF, w.N - n0);
    if (valid <= 0) break;
    const __m256i mask = lane_mask(valid);
    const __m256 bv = bias != nullptr ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
    for (int m = 0; m < R; ++m) _mm256_maskstore_ps(y + (m0 + m) * w.N + n0, mask, _mm256_add_ps(acc[j][m], bv));
  }
}

}  // namespace edgellm::cpu::ymm
