// RMSNorm (norm.cpp): the rms_norm op and the row helpers the fused decode pass uses.
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>

namespace edgellm::cpu {

// out = x / sqrt(mean(x^2) + eps) * w for one row of H (fp32, scalar: the fused decode's numerics).
void rmsnorm(const float* x, const float* w, float* out, int64_t H, float eps);
// The same for the rms_norm op (AVX-512 sums in two accumulators).
void rmsnorm_row(const float* x, const float* w, float* out, int64_t H, float eps);

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);

}  // namespace edgellm::cpu
