// Rotary embedding (neox halves) in place: the rotate_ op and the rows helper of the fused decode.
#include "rotary.h"

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

namespace edgellm::cpu {

// Rotary (neox halves) in place on the first `heads` heads of each row of x [T, W] fp32 (row
// stride W, e.g. a qkv projection: q heads, then k heads, then v). cos/sin [T, D] fp32.
void rotate_rows(float* x, int64_t stride, const float* cp, const float* snp, int64_t T, int64_t heads,
                 int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* v = x + t * stride + hh * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[i] - x2 * s[i];
          v[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

at::Tensor rotate_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: [T, W] fp32, rows contiguous");
  TORCH_CHECK(heads * head_dim <= x.size(1) && head_dim % 2 == 0, "heads * head_dim within a row");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == x.size(0) * head_dim && sin.numel() == x.size(0) * head_dim,
              "cos/sin: [T, head_dim] fp32 contiguous");
  pybind11::gil_scoped_release no_gil;
  rotate_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads,
              head_dim);
  return x;
}

}  // namespace edgellm::cpu
