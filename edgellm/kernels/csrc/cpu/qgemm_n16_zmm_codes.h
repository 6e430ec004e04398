// A 32-column block's codes of one n16 tile unpacked into the eight layout rows' 64 bytes (zmm
// registers), as the AVX-512 VNNI tiles (qgemm_n16_zmm.cpp) and the AMX B tiles (qgemm_amx.cpp)
// read them; the layout is qgemm_n16.h's. Included only by builds with AVX-512 BW.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace edgellm::cpu {

// Layout row r's stored codes e[64 r .. 64 r + 63] of the block at p, for r = 0..7. int4: the low
// nibbles are rows 0-3, the high nibbles rows 4-7. 5/6 bits: the int4 bytes for bits 0-3, and
// bit 4 (5) of row r is bit r of its plane byte: a 16-bit shift by 4 - r (5 - r) puts it in
// place, and every bit the shift carries across a byte boundary lands outside the mask.
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
    if constexpr (BITS >= 5) {
      const __m512i plane = _mm512_loadu_si512(p + 256), bit = _mm512_set1_epi8(0x10);
      wv[0] = _mm512_ternarylogic_epi32(wv[0], _mm512_slli_epi16(plane, 4), bit, 0xF8);  // a | (b & c)
      wv[1] = _mm512_ternarylogic_epi32(wv[1], _mm512_slli_epi16(plane, 3), bit, 0xF8);
      wv[2] = _mm512_ternarylogic_epi32(wv[2], _mm512_slli_epi16(plane, 2), bit, 0xF8);
      wv[3] = _mm512_ternarylogic_epi32(wv[3], _mm512_slli_epi16(plane, 1), bit, 0xF8);
      wv[4] = _mm512_ternarylogic_epi32(wv[4], plane, bit, 0xF8);
      wv[5] = _mm512_ternarylogic_epi32(wv[5], _mm512_srli_epi16(plane, 1), bit, 0xF8);
      wv[6] = _mm512_ternarylogic_epi32(wv[6], _mm512_srli_epi16(plane, 2), bit, 0xF8);
      wv[7] = _mm512_ternarylogic_epi32(wv[7], _mm512_srli_epi16(plane, 3), bit, 0xF8);
    }
    if constexpr (BITS == 6) {
      const __m512i plane = _mm512_loadu_si512(p + 320), bit = _mm512_set1_epi8(0x20);
      wv[0] = _mm512_ternarylogic_epi32(wv[0], _mm512_slli_epi16(plane, 5), bit, 0xF8);
      wv[1] = _mm512_ternarylogic_epi32(wv[1], _mm512_slli_epi16(plane, 4), bit, 0xF8);
      wv[2] = _mm512_ternarylogic_epi32(wv[2], _mm512_slli_epi16(plane, 3), bit, 0xF8);
      wv[3] = _mm512_ternarylogic_epi32(wv[3], _mm512_slli_epi16(plane, 2), bit, 0xF8);
      wv[4] = _mm512_ternarylogic_epi32(wv[4], _mm512_slli_epi16(plane, 1), bit, 0xF8);
      wv[5] = _mm512_ternarylogic_epi32(wv[5], plane, bit, 0xF8);
      wv[6] = _mm512_ternarylogic_epi32(wv[6], _mm512_srli_epi16(plane, 1), bit, 0xF8);
      wv[7] = _mm512_ternarylogic_epi32(wv[7], _mm512_srli_epi16(plane, 2), bit, 0xF8);
    }
  }
}

}  // namespace edgellm::cpu
