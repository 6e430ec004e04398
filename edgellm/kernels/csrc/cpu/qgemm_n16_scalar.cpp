// The n16 tiles in scalar code, for builds without AVX2 (the contract: qgemm_n16.h): the layout's
// codes read back one at a time and summed as the vector tiles sum them (qgemm_n16_zmm.cpp,
// qgemm_n16_ymm.cpp, qgemm_n16_avx2.cpp), the exact integer block dots scaled per output and block.
#include "qgemm_n16.h"

#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__) && !defined(__AVX2__)
#include <algorithm>

namespace edgellm::cpu {
namespace {

// code of output 16 t + n, column 32 b + k (the layout's statement, read back)
template <int BITS>
inline int32_t code_at(const uint8_t* block, int64_t n, int64_t k, int32_t zero) {
  const int64_t e = (k / 4) * 64 + n * 4 + k % 4;
  if constexpr (BITS == 8) return static_cast<int32_t>(block[e]) - zero;
  int32_t c = e < 256 ? (block[e] & 15) : (block[e - 256] >> 4);
  if constexpr (BITS >= 5) c |= ((block[256 + e % 64] >> (e / 64)) & 1) << 4;
  if constexpr (BITS == 6) c |= ((block[320 + e % 64] >> (e / 64)) & 1) << 5;
  return c - zero;
}

}  // namespace

template <int BITS, typename S>
void n16_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y, const float* bias) {
  for (int64_t t = t0; t < t1; ++t) {
    const GroupScales<S> s = w.scales(t), o = w.offsets(t);
    const int64_t valid = std::min<int64_t>(N16, w.N - t * N16);
    for (int64_t n = 0; n < valid; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* a = x.a + m * x.K;
        float acc = 0.f;
        for (int64_t b = 0; b < w.nb; ++b) {
          const uint8_t* block = w.q + t * w.tile_bytes() + b * w.block_bytes;
          int32_t dot[2] = {0, 0};
          for (int64_t k = 0; k < QB; ++k) dot[k / 16] += code_at<BITS>(block, n, k, w.zero) * a[b * QB + k];
          const float s_lo = s.at(w.bpg ? b / w.bpg : 2 * b, n);
          const float s_hi = w.bpg ? s_lo : s.at(2 * b + 1, n);
          acc += (static_cast<float>(dot[0]) * s_lo + static_cast<float>(dot[1]) * s_hi) * x.d[m * x.nb + b];
        }
        if (o.v != nullptr)
          for (int64_t g = 0; g < w.G; ++g) acc += o.at(g, n) * x.dsum[m * x.G + g];
        y[m * w.N + t * N16 + n] = acc + (bias != nullptr ? bias[t * N16 + n] : 0.f);
      }
    }
  }
}

EDGELLM_N16_INSTANTIATE(n16_tiles)

}  // namespace edgellm::cpu
#endif
