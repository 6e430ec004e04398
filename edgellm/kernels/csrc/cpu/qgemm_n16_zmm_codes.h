// A 32-column block's codes of one n16 tile unpacked into the eight layout rows' 64 bytes (zmm
// registers), as the AVX-512 VNNI tiles (qgemm_n16_zmm.cpp) and the AMX B tiles (qgemm_amx.cpp)
// read them; the layout is qgemm_n16.h's. Included only by builds with AVX-512 BW.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace edgellm::cpu {

// ORs bit BIT of every stored code from the plane at p into the eight layout rows wv: bit r of a
// plane byte is row r's, and a 16-bit shift by BIT - r puts it in place (every bit the shift
// carries across a byte boundary lands outside the mask).
template <int BIT>
inline void or_plane_zmm(const uint8_t* p, __m512i (&wv)[8]) {
  const __m512i plane = _mm512_loadu_si512(p), bit = _mm512_set1_epi8(static_cast<char>(1 << BIT));
  for (int r = 0; r < 8; ++r) {
    const __m512i v = r <= BIT ? _mm512_slli_epi16(plane, BIT - r) : _mm512_srli_epi16(plane, r - BIT);
    wv[r] = _mm512_ternarylogic_epi32(wv[r], v, bit, 0xF8);  // a | (b & c)
  }
}

// Layout row r's stored codes e[64 r .. 64 r + 63] of the block at p, for r = 0..7. int4: the low
// nibbles are rows 0-3, the high nibbles rows 4-7. 5/6 bits: the int4 bytes for bits 0-3, then
// bit 4 (and 5) from the planes after them.
template <int BITS>
inline void unpack_codes_zmm(const uint8_t* p, __m512i (&wv)[8]) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < 8; ++i) wv[i] = _mm512_loadu_si512(p + 64 * i);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(p + 64 * i);
      wv[i] = _mm512_and_si512(raw, low4);
      wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if constexpr (BITS >= 5) or_plane_zmm<4>(p + 256, wv);
    if constexpr (BITS == 6) or_plane_zmm<5>(p + 320, wv);
  }
}

}  // namespace edgellm::cpu
