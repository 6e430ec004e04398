// Integer-dot matmuls over the n16 layout (the contract: qgemm_n16.h): the op, its checks and the
// split of the tiles over torch's threads. The tiles themselves run in the widest vpdpbusd the
// build has: qgemm_n16_zmm.cpp (AVX-512 VNNI), qgemm_n16_ymm.cpp (AVX-VNNI, 256 bits), AMX tiles
// for many rows (qgemm_amx.cpp); AVX2 without VNNI, qgemm_n16_avx2.cpp (vpmaddubsw); without AVX2,
// qgemm_n16_scalar.cpp (the sums' scalar statement).
#include "qgemm_n16.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>

#include <algorithm>

namespace edgellm::cpu {
namespace {

template <int BITS, typename S>
void run(const N16Weights<S>& w, const QActs& x, int64_t M, float* y, const float* bias, bool amx) {
  at::parallel_for(0, w.NT, 1, [&](int64_t t0, int64_t t1) {
    if (amx) {
      amx_tiles<BITS, S>(w, t0, t1, x, M, y, bias);
    } else {
      n16_tiles<BITS, S>(w, t0, t1, x, M, y, bias);
    }
  });
}

}  // namespace

const char* n16_variant() {
#if defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor int_linear_n16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                          const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias, int64_t n,
                          int64_t amx_rows, int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32, contiguous");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  if (zero < 0) zero = n16_zero(static_cast<int>(bits));
  TORCH_CHECK(zero == n16_zero(static_cast<int>(bits)) || zero == n16_other_zero(static_cast<int>(bits)),
              "zero must be ", n16_zero(static_cast<int>(bits)),
              n16_other_zero(static_cast<int>(bits)) >= 0
                  ? " or " + std::to_string(n16_other_zero(static_cast<int>(bits)))
                  : std::string(),
              " for ", bits, "-bit codes, got ", zero);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK((group == QB / 2 && bits != 4) || (group > 0 && group % QB == 0),
              "group must be a multiple of 32 (or 16 for int8 and 5/6-bit codes), got ", group);
  TORCH_CHECK(K % QB == 0 && K % group == 0, "K = ", K, " must be a multiple of 32 and of the group ", group);
  const int64_t NT = (n + N16 - 1) / N16, nb = K / QB, G = K / group, block_bytes = n16_block_bytes(bits);
  TORCH_CHECK(n > 0 && qweight.dim() == 3 && qweight.size(0) == NT && qweight.size(1) == nb &&
                  qweight.size(2) == block_bytes && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "qweight: [ceil(N / 16), K / 32, ", block_bytes, "] uint8 (the n16 layout), contiguous");
  const bool compact = scale.scalar_type() == at::kChar;
  int64_t gps = 0;  // the compact form's groups per base
  if (compact) {
    const int64_t extra = scale.dim() == 2 ? scale.size(1) - G * N16 : -1, bases = extra / 64;
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == NT && extra > 0 && extra % 64 == 0 && G % bases == 0 &&
                    scale.is_contiguous(),
                "compact scale: int8 [ceil(N / 16), K / group * 16 + B * 64] (multipliers, then B fp32 bases per "
                "16 outputs, B dividing K / group), contiguous");
    gps = G / bases;
  } else {
    TORCH_CHECK(scale.dim() == 3 && scale.size(0) == NT && scale.size(1) == G && scale.size(2) == N16 &&
                    scale.is_contiguous() && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
                "scale: [ceil(N / 16), K / group, 16] fp32 or fp16, contiguous (or the compact int8 form)");
  }
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
                          NT, nb, G, group / QB, n, block_bytes, gps, static_cast<int32_t>(zero)};
    switch (bits) {
      case 4: run<4, S>(w, acts, M, y.data_ptr<float>(), bp, amx); break;
      case 5: run<5, S>(w, acts, M, y.data_ptr<float>(), bp, amx); break;
      case 6: run<6, S>(w, acts, M, y.data_ptr<float>(), bp, amx); break;
      default: run<8, S>(w, acts, M, y.data_ptr<float>(), bp, amx); break;
    }
  };
  if (compact) {
    go(int8_t{});
  } else if (scale.scalar_type() == at::kFloat) {
    go(float{});
  } else {
    go(c10::Half{});
  }
  return y;
}

at::Tensor int_linear_n16_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                             const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias,
                             int64_t n, int64_t amx_rows, int64_t zero) {
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  return int_linear_n16(x, qweight, scale, offset, bits, group, bias, n, amx_rows, zero);
}

}  // namespace edgellm::cpu
