// SiLU-and-mul for the MLP of prefill-sized steps: to bf16 (the bf16 intermediate) or fp32.
#include "activation.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>
#include <cmath>

#include "vec.h"

namespace edgellm::cpu {

// silu(gate) * up for gu [T, 2 I] (gate | up per row; bf16 or fp32, rows contiguous) -> [T, I] bf16,
// computed in fp32 and rounded once to bf16 (nearest even). The MLP of prefill-sized steps in
// CPU fast mode: torch's bf16 silu and mul are two passes, each widening to fp32 and rounding.
at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.stride(1) == 1, "gu: [T, 2 I], rows contiguous");
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 || gu.scalar_type() == at::kFloat, "gu: bf16 or fp32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, rs = gu.stride(0);
  auto out = at::empty({T, I}, gu.options().dtype(at::kBFloat16));
  pybind11::gil_scoped_release no_gil;
  const bool bf = gu.scalar_type() == at::kBFloat16;
  const c10::BFloat16* gb = bf ? gu.data_ptr<c10::BFloat16>() : nullptr;
  const float* gf = bf ? nullptr : gu.data_ptr<float>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t i = 0;
#if defined(__AVX512BF16__)
      for (; i + 16 <= I; i += 16) {
        __m512 g, u;
        if (bf) {
          const __m256i gr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + t * rs + i));
          const __m256i ur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + t * rs + I + i));
          g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(gr), 16));
          u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ur), 16));
        } else {
          g = _mm512_loadu_ps(gf + t * rs + i);
          u = _mm512_loadu_ps(gf + t * rs + I + i);
        }
        const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(sig, u));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t * I + i), (__m256i)y);
      }
#endif
      for (; i < I; ++i) {
        const float g = bf ? static_cast<float>(gb[t * rs + i]) : gf[t * rs + i];
        const float u = bf ? static_cast<float>(gb[t * rs + I + i]) : gf[t * rs + I + i];
        op[t * I + i] = c10::BFloat16(g / (1.f + std::exp(-g)) * u);
      }
    }
  });
  return out;
}

// silu(gate) * up for fp32 gu [T, 2 I] (rows contiguous) -> [T, I] fp32 in one pass (torch's silu
// and mul are two, with a [T, I] temporary between): exp within 2 ulp of expf (exp16).
at::Tensor silu_mul_f32(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.stride(1) == 1, "gu: [T, 2 I], rows contiguous");
  TORCH_CHECK(gu.scalar_type() == at::kFloat, "gu: fp32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, rs = gu.stride(0);
  auto out = at::empty({T, I}, gu.options());
  pybind11::gil_scoped_release no_gil;
  const float* g = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gr = g + t * rs;
      const float* ur = gr + I;
      float* yr = op + t * I;
      int64_t i = 0;
#if defined(EDGELLM_V16)
      const V16 one = v16_set1(1.f);
      for (; i + 16 <= I; i += 16) {
        const V16 gv = v16_load(gr + i);
        const V16 sig = v16_div(gv, v16_add(one, exp16(v16_sub(v16_zero(), gv))));
        v16_store(yr + i, v16_mul(sig, v16_load(ur + i)));
      }
#endif
      for (; i < I; ++i) yr[i] = gr[i] / (1.f + std::exp(-gr[i])) * ur[i];
    }
  });
  return out;
}

}  // namespace edgellm::cpu
