// Integer-dot matmuls over the n16 layout (the contract: qgemm_n16.h).
//
// AVX-512 VNNI (built for levels avx512 + vnni and amx): a tile's 16 outputs are the 16 int32
// lanes of one zmm. Per 32-column block the 8 layout rows (64 bytes each) are loaded once
// (int4: 4 loads, one mask and one shift) and shared by up to MR activation rows; each row r
// adds vpdpbusd(codes_r, the row's 4 activation bytes of columns 4 r .. 4 r + 3 broadcast) into
// an int32 accumulator that starts at -128 * (the block's code sum) for int8 (undoing the
// stored + 128), so the block dot is exact. It is converted and scaled by one FMA per block
// (scale per output lane times the block's step); offsets add offset * dsum per group. No
// horizontal sums: the lanes are the outputs. Elsewhere: the same sums in scalar code.
// Work is split over torch's threads by tiles.
#include "qgemm_n16.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {
namespace {

inline float scalar_of(float v) { return v; }
inline float scalar_of(c10::Half v) { return static_cast<float>(v); }

#if defined(__AVX512VNNI__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Outputs of tile t for activation rows m0 .. m0 + MR.
template <int BITS, int MR, typename S>
void vnni_rows(const N16Weights<S>& w, int64_t t, const QActs& x, int64_t m0, float* y, int64_t ldy,
               const float* bias) {
  const uint8_t* base = w.q + t * w.tile_bytes();
  const S* scales = w.scale + t * w.G * N16;
  const int8_t* xa[MR];
  const float* xd[MR];
  const int32_t* xs[MR];
  for (int m = 0; m < MR; ++m) {
    xa[m] = x.a + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * x.nb;
    xs[m] = x.isum + (m0 + m) * 2 * x.nb;
  }
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t b = 0, left = 0, g = 0; b < w.nb; ++b) {
    const uint8_t* p = base + b * w.block_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * w.block_bytes), _MM_HINT_T0);
    __m512i wv[8];
    if constexpr (BITS == 4) {
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(p + 64 * i);
        wv[i] = _mm512_and_si512(raw, low4);
        wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
    } else {
      for (int i = 0; i < 8; ++i) wv[i] = _mm512_loadu_si512(p + 64 * i);
    }
    if (w.bpg == 0) {  // groups of 16 (int8): each half block has its own scales
      const __m512 s_lo = load16(scales + 2 * b * N16), s_hi = load16(scales + (2 * b + 1) * N16);
      for (int m = 0; m < MR; ++m) {
        const int8_t* a = xa[m] + b * QB;
        __m512i lo = _mm512_set1_epi32(-128 * xs[m][2 * b]), hi = _mm512_set1_epi32(-128 * xs[m][2 * b + 1]);
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
      sv = load16(scales + g++ * N16);
      left = w.bpg - 1;
    }
    for (int m = 0; m < MR; ++m) {
      const int8_t* a = xa[m] + b * QB;
      __m512i s = BITS == 8 ? _mm512_set1_epi32(-128 * (xs[m][2 * b] + xs[m][2 * b + 1])) : _mm512_setzero_si512();
      for (int r = 0; r < 8; ++r) s = _mm512_dpbusd_epi32(s, wv[r], bcast4(a + 4 * r));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_set1_ps(xd[m][b])), acc[m]);
    }
  }
  if (w.offset != nullptr) {
    const S* offs = w.offset + t * w.G * N16;
    for (int64_t g = 0; g < w.G; ++g) {
      const __m512 ov = load16(offs + g * N16);
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(x.dsum[(m0 + m) * x.G + g]), acc[m]);
    }
  }
  const int64_t n0 = t * N16, valid = std::min<int64_t>(N16, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, mask, _mm512_add_ps(acc[m], bv));
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

template <int BITS, typename S>
void tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y, const float* bias) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) vnni_rows<BITS, MR>(w, t, x, m, y, w.N, bias);
    if (m < M) vnni_rest<BITS>(w, t, x, m, M - m, y, bias);
  }
}
#else
// code of output 16 t + n, column 32 b + k (the layout's statement, read back)
template <int BITS>
inline int32_t code_at(const uint8_t* block, int64_t n, int64_t k) {
  const int64_t e = (k / 4) * 64 + n * 4 + k % 4;
  if constexpr (BITS == 4) return e < 256 ? (block[e] & 15) : (block[e - 256] >> 4);
  return static_cast<int32_t>(block[e]) - 128;
}

template <int BITS, typename S>
void tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y, const float* bias) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t valid = std::min<int64_t>(N16, w.N - t * N16);
    for (int64_t n = 0; n < valid; ++n) {
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* a = x.a + m * x.K;
        float acc = 0.f;
        for (int64_t b = 0; b < w.nb; ++b) {
          const uint8_t* block = w.q + t * w.tile_bytes() + b * w.block_bytes;
          int32_t dot[2] = {0, 0};
          for (int64_t k = 0; k < QB; ++k) dot[k / 16] += code_at<BITS>(block, n, k) * a[b * QB + k];
          const S* s = w.scale + t * w.G * N16;
          const float s_lo = scalar_of(s[(w.bpg ? b / w.bpg : 2 * b) * N16 + n]);
          const float s_hi = w.bpg ? s_lo : scalar_of(s[(2 * b + 1) * N16 + n]);
          acc += (static_cast<float>(dot[0]) * s_lo + static_cast<float>(dot[1]) * s_hi) * x.d[m * x.nb + b];
        }
        if (w.offset != nullptr)
          for (int64_t g = 0; g < w.G; ++g) acc += scalar_of(w.offset[(t * w.G + g) * N16 + n]) * x.dsum[m * x.G + g];
        y[m * w.N + t * N16 + n] = acc + (bias != nullptr ? bias[t * N16 + n] : 0.f);
      }
    }
  }
}
#endif

template <int BITS, typename S>
void run(const N16Weights<S>& w, const QActs& x, int64_t M, float* y, const float* bias, bool amx) {
  at::parallel_for(0, w.NT, 1, [&](int64_t t0, int64_t t1) {
    if (amx) {
      amx_tiles<BITS, S>(w, t0, t1, x, M, y, bias);
    } else {
      tiles<BITS, S>(w, t0, t1, x, M, y, bias);
    }
  });
}

}  // namespace

at::Tensor int_linear_n16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                          const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias, int64_t n,
                          int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32, contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK((group == QB / 2 && bits == 8) || (group > 0 && group % QB == 0),
              "group must be a multiple of 32 (or 16 for int8 codes), got ", group);
  TORCH_CHECK(K % QB == 0 && K % group == 0, "K = ", K, " must be a multiple of 32 and of the group ", group);
  const int64_t NT = (n + N16 - 1) / N16, nb = K / QB, G = K / group, block_bytes = bits == 4 ? 256 : 512;
  TORCH_CHECK(n > 0 && qweight.dim() == 3 && qweight.size(0) == NT && qweight.size(1) == nb &&
                  qweight.size(2) == block_bytes && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "qweight: [ceil(N / 16), K / 32, ", block_bytes, "] uint8 (the n16 layout), contiguous");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == NT && scale.size(1) == G && scale.size(2) == N16 &&
                  scale.is_contiguous() && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale: [ceil(N / 16), K / group, 16] fp32 or fp16, contiguous");
  const bool has_offset = offset.numel() > 0;
  TORCH_CHECK(!has_offset || (offset.sizes() == scale.sizes() && offset.scalar_type() == scale.scalar_type() &&
                              offset.is_contiguous()),
              "offset: like scale, or empty");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == n && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias: [N] fp32, or empty");
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const bool amx = M >= amx_rows && amx_ready();
  const int64_t rows = amx ? (M + N16 - 1) / N16 * N16 : M;  // AMX reads whole 16-row tiles
  const QActs acts = act_scratch().quantize(x.data_ptr<float>(), M, rows, K, group);
  const float* bp = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  auto go = [&](auto tag) {
    using S = decltype(tag);
    const N16Weights<S> w{qweight.data_ptr<uint8_t>(), reinterpret_cast<const S*>(scale.data_ptr()),
                          has_offset ? reinterpret_cast<const S*>(offset.data_ptr()) : nullptr,
                          NT, nb, G, group / QB, n, block_bytes};
    if (bits == 4) {
      run<4, S>(w, acts, M, y.data_ptr<float>(), bp, amx);
    } else {
      run<8, S>(w, acts, M, y.data_ptr<float>(), bp, amx);
    }
  };
  if (scale.scalar_type() == at::kFloat) {
    go(float{});
  } else {
    go(c10::Half{});
  }
  return y;
}

at::Tensor int_linear_n16_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                             const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias,
                             int64_t n, int64_t amx_rows) {
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  return int_linear_n16(x, qweight, scale, offset, bits, group, bias, n, amx_rows);
}

}  // namespace edgellm::cpu
