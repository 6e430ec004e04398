// One group's 16 scales (or offsets) of an n16 tile as a zmm of fp32, in the three forms of
// qgemm_n16.h (fp32, fp16, and the compact int8 multipliers times their fp32 bases), as the
// AVX-512 VNNI tiles (qgemm_n16_zmm.cpp) and the AMX tiles (qgemm_amx.cpp) read them. Included
// only by builds with AVX-512.
#pragma once

#include <immintrin.h>

#include "qgemm_n16.h"

namespace edgellm::cpu {

inline __m512 load16(const GroupScales<float>& s, int64_t g) { return _mm512_loadu_ps(s.v + g * N16); }
inline __m512 load16(const GroupScales<c10::Half>& s, int64_t g) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.v + g * N16)));
}
// the multipliers sign-extended and converted (exact), times the base: the fp32 form's value
inline __m512 load16(const GroupScales<int8_t>& s, int64_t g) {
  const __m512i m = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.v + g * N16)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_loadu_ps(s.base + g / s.gps * N16));
}

}  // namespace edgellm::cpu
