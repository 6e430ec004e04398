// Integer-dot matmuls for int4 and int8 weights with int8 activations (the contract: qgemm.h).
//
// Activations are quantized once per call, per row and 32-column block (llama.cpp's Q8_0 rule;
// qacts.h, into the calling thread's scratch buffers), then every output is a sum over blocks of d_b * scale * dot(q_b, a_b) with the block dot in
// exact integer arithmetic:
//   AVX2: int4 codes are unsigned (0..15), so vpmaddubsw multiplies them with the signed
//   activations directly (pairs of u8 x s8 into s16: at most 2 * 15 * 127, no saturation), then
//   vpmaddwd against ones sums pairs into 8 int32 lanes. int8 codes take the sign trick
//   (|w| x sign(a, w)), at most 2 * 128 * 127 per pair. The block's 8 lanes are converted to
//   fp32 and accumulated with the block's scale by one FMA; one horizontal sum per output.
//   int4 blocks go two at a time (see tile()), halving the unpack, convert and FMA work.
//   A zero point or offset adds offset * sum_b d_b * sum(a_b), precomputed per activation group.
//   Elsewhere (no AVX2) the same sums in scalar code.
// Work is split over torch's threads by tiles of output rows; each tile's weight rows stay in
// L1 while every activation row passes over them. The engine runs the n16 layout (qgemm_n16.h)
// at every AVX2 level; this row layout is the baseline it is tested and measured against
// (tests/kernels/test_cpu_int.py, benchmarks/cpu_int_dot.py).
#include "qgemm.h"

#include "qacts.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {
namespace {

inline float load_scale(const float* p) { return *p; }
inline float load_scale(const c10::Half* p) {
#if defined(__F16C__)
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[0]);
#else
  return static_cast<float>(*p);
#endif
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [v[0] x 4, v[1] x 4]: two consecutive per-block (or per-group) factors as one vector whose low
// 128 bits scale block b and high 128 bits block b + 1.
inline __m256 pair_of(const float* v) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
inline __m256 pair_of(const c10::Half* v) {
  int32_t bits;
  std::memcpy(&bits, v, sizeof(bits));
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
#endif

template <typename S>
struct Weights {
  const uint8_t* q;    // int4: [N, K / 2]; int8: [N, K] (as bytes)
  const S* scale;      // [N, G]
  const S* offset;     // [N, G] or nullptr
  int64_t row_bytes, G, blocks_per_group;
};

// sum_g o[g] * ds[g] over G groups (offset x per-group activation sums), o fp32 or fp16.
template <typename S>
inline float offset_dot(const S* o, const float* ds, int64_t G) {
  int64_t g = 0;
  float sum = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= G; g += 8) {
    __m256 ov;
    if constexpr (std::is_same_v<S, float>) {
      ov = _mm256_loadu_ps(o + g);
    } else {
      ov = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + g)));
    }
    acc = _mm256_fmadd_ps(ov, _mm256_loadu_ps(ds + g), acc);
  }
  sum = hsum8(acc);
#endif
  for (; g < G; ++g) sum += load_scale(o + g) * ds[g];
  return sum;
}

// Outputs y[m][n0 .. n0 + NR) for the activation rows m0 .. m0 + MR.
template <int BITS, int NR, int MR, typename S>
void tile(const Weights<S>& w, int64_t n0, const QActs& x, int64_t m0, float* y, int64_t ldy, const float* bias) {
  constexpr int64_t BLOCK_BYTES = BITS == 4 ? QB / 2 : QB;
  const uint8_t* wq[NR];
  const S* ws[NR];
  for (int r = 0; r < NR; ++r) {
    wq[r] = w.q + (n0 + r) * w.row_bytes;
    ws[r] = w.scale + (n0 + r) * w.G;
  }
  const int8_t* xa[MR];
  const float* xd[MR];
  for (int m = 0; m < MR; ++m) {
    xa[m] = x.a + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * x.nb;
  }
  const int64_t nb = x.nb, bpg = w.blocks_per_group;
#if defined(__AVX2__)
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sv[NR];
  int64_t b0 = 0;
  if constexpr (BITS == 4) {
    // Two blocks per step: the 32 bytes of blocks b, b + 1 unpack by one mask and one shift into
    // [codes 0..15 of b | of b + 1] and [codes 16..31 of b | of b + 1]; the activations are
    // shuffled to match (once per row, shared by the tile's NR weight rows), the two u8 x s8
    // products added in 16 bits (4 * 15 * 127 < 2^15), and lanes 0-3 / 4-7 of the int32 sums
    // scaled by block b's / b + 1's factors. The next tile's rows are prefetched meanwhile.
    const int64_t next_tile = 4 * NR * w.row_bytes;
    for (; b0 + 2 <= nb; b0 += 2) {
      const int64_t g0 = b0 / bpg, g1 = (b0 + 1) / bpg;
      __m256i al[MR], ah[MR];
      __m256 dv[MR];
      for (int m = 0; m < MR; ++m) {
        const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa[m] + b0 * QB));
        const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa[m] + (b0 + 1) * QB));
        al[m] = _mm256_permute2x128_si256(a0, a1, 0x20);
        ah[m] = _mm256_permute2x128_si256(a0, a1, 0x31);
        dv[m] = pair_of(xd[m] + b0);
      }
      // one weight row at a time (its unpacked codes shared by the MR activation rows), so the
      // live vectors stay within the 16 ymm registers
      for (int r = 0; r < NR; ++r) {
        const uint8_t* p = wq[r] + b0 * BLOCK_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(p + next_tile), _MM_HINT_T0);
        const __m256 s = g0 == g1 ? _mm256_set1_ps(load_scale(ws[r] + g0)) : pair_of(ws[r] + g0);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int m = 0; m < MR; ++m) {
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, al[m]), _mm256_maddubs_epi16(hi, ah[m]));
          const __m256 prod = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
          acc[r][m] = _mm256_fmadd_ps(prod, _mm256_mul_ps(s, dv[m]), acc[r][m]);
        }
      }
    }
  }
  for (int64_t b = b0, left = 0, g = bpg > 0 ? b0 / bpg : 0; b < nb; ++b, --left) {
    if (bpg == 0) {  // group 16: lanes 0-3 (columns 0..15) and 4-7 (16..31) have their own scales
      for (int r = 0; r < NR; ++r) sv[r] = pair_of(ws[r] + 2 * b);
    } else if (left == 0) {  // a new weight group (or the first block after the pairs): its scales
      for (int r = 0; r < NR; ++r) sv[r] = _mm256_set1_ps(load_scale(ws[r] + g));
      left = bpg - b % bpg;
      ++g;
    }
    __m256i av[MR];
    __m256 dv[MR];
    for (int m = 0; m < MR; ++m) {
      av[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa[m] + b * QB));
      dv[m] = _mm256_broadcast_ss(xd[m] + b);
    }
    for (int r = 0; r < NR; ++r) {  // one weight row at a time, as above
      const uint8_t* p = wq[r] + b * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(p + NR * w.row_bytes), _MM_HINT_T0);
      __m256i q, qa = _mm256_setzero_si256();
      if constexpr (BITS == 4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
      } else {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        qa = _mm256_sign_epi8(q, q);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i p16 = BITS == 4 ? _mm256_maddubs_epi16(q, av[m])
                                      : _mm256_maddubs_epi16(qa, _mm256_sign_epi8(av[m], q));
        const __m256 prod = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r][m] = _mm256_fmadd_ps(prod, _mm256_mul_ps(sv[r], dv[m]), acc[r][m]);
      }
    }
  }
#else
  float acc[NR][MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = wq[r] + b * BLOCK_BYTES;
      // group 16: each half block has its own scale
      const float s_lo = load_scale(ws[r] + (bpg > 0 ? b / bpg : 2 * b));
      const float s_hi = bpg > 0 ? s_lo : load_scale(ws[r] + 2 * b + 1);
      for (int m = 0; m < MR; ++m) {
        const int8_t* av = xa[m] + b * QB;
        int32_t dot_lo = 0, dot_hi = 0;
        for (int64_t j = 0; j < QB; ++j) {
          int32_t qj;
          if constexpr (BITS == 4) {
            qj = j < QB / 2 ? (p[j] & 15) : (p[j - QB / 2] >> 4);
          } else {
            qj = static_cast<int8_t>(p[j]);
          }
          (j < QB / 2 ? dot_lo : dot_hi) += qj * av[j];
        }
        acc[r][m] += static_cast<float>(dot_lo) * (s_lo * xd[m][b]) + static_cast<float>(dot_hi) * (s_hi * xd[m][b]);
      }
    }
  }
#endif
  for (int r = 0; r < NR; ++r) {
    const float bv = bias != nullptr ? bias[n0 + r] : 0.f;
    for (int m = 0; m < MR; ++m) {
#if defined(__AVX2__)
      float out = hsum8(acc[r][m]);
#else
      float out = acc[r][m];
#endif
      if (w.offset != nullptr) out += offset_dot(w.offset + (n0 + r) * w.G, x.dsum + (m0 + m) * x.G, w.G);
      y[(m0 + m) * ldy + n0 + r] = out + bv;
    }
  }
}

constexpr int NR = 4;  // output rows per tile
constexpr int MR = 2;  // activation rows sharing one pass over the tile's unpacked weights

template <int BITS, int R, typename S>
void rows(const Weights<S>& w, int64_t n0, const QActs& x, int64_t M, float* y, int64_t ldy, const float* bias) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<BITS, R, MR>(w, n0, x, m, y, ldy, bias);
  for (; m < M; ++m) tile<BITS, R, 1>(w, n0, x, m, y, ldy, bias);
}

template <int BITS, typename S>
void run(const Weights<S>& w, int64_t N, const QActs& x, int64_t M, float* y, const float* bias) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR;
      if (n0 + NR <= N) {
        rows<BITS, NR>(w, n0, x, M, y, N, bias);
      } else {
        for (int64_t n = n0; n < N; ++n) rows<BITS, 1>(w, n, x, M, y, N, bias);
      }
    }
  });
}

void quantize(const at::Tensor& x, int64_t group, at::Tensor& a, at::Tensor& d, at::Tensor& dsum) {
  const int64_t M = x.size(0), K = x.size(1);
  a = at::empty({M, K}, x.options().dtype(at::kChar));
  d = at::empty({M, K / QB}, x.options());
  dsum = at::empty({M, K / group}, x.options());
  quantize_into(x.data_ptr<float>(), M, K, group, a.data_ptr<int8_t>(), d.data_ptr<float>(), dsum.data_ptr<float>(),
                nullptr);
}

void check_acts(const at::Tensor& x, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32, contiguous");
  TORCH_CHECK((group == QB / 2 || (group > 0 && group % QB == 0)) && x.size(1) % std::max<int64_t>(group, QB) == 0,
              "group must be 16 or a multiple of 32, dividing K (a multiple of 32), got ", group,
              " for K = ", x.size(1));
}

}  // namespace

std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t group) {
  check_acts(x, group);
  at::Tensor a, d, dsum;
  quantize(x, group, a, d, dsum);
  return {a, d, dsum};
}

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias) {
  check_acts(x, group);
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 &&
                  qweight.size(1) == (bits == 4 ? K / 2 : K),
              "qweight: [N, K / 2] uint8 (int4) or [N, K] int8, contiguous");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == G && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale: [N, K / group] fp32 or fp16, contiguous");
  const bool has_offset = offset.numel() > 0;
  TORCH_CHECK(!has_offset || (offset.sizes() == scale.sizes() && offset.scalar_type() == scale.scalar_type() &&
                              offset.is_contiguous()),
              "offset: like scale, or empty");
  TORCH_CHECK(bits == 8 || group >= QB, "int4 weights take groups of 32 or more");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias: [N] fp32, or empty");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QActs acts = act_scratch().quantize(x.data_ptr<float>(), M, M, K, group);
  const float* bp = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  auto go = [&](auto tag) {
    using S = decltype(tag);
    const Weights<S> w{static_cast<const uint8_t*>(qweight.data_ptr()), reinterpret_cast<const S*>(scale.data_ptr()),
                       has_offset ? reinterpret_cast<const S*>(offset.data_ptr()) : nullptr, qweight.size(1), G,
                       group / QB};
    if (bits == 4) {
      run<4>(w, N, acts, M, y.data_ptr<float>(), bp);
    } else {
      run<8>(w, N, acts, M, y.data_ptr<float>(), bp);
    }
  };
  if (scale.scalar_type() == at::kFloat) {
    go(float{});
  } else {
    go(c10::Half{});
  }
  return y;
}

at::Tensor int_linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias) {
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  return int_linear(x, qweight, scale, offset, bits, group, bias);
}

}  // namespace edgellm::cpu
