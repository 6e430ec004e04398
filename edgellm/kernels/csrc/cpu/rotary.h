// Rotary embedding, neox halves (rotary.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>

namespace edgellm::cpu {

// In place on the first `heads` heads of each of T rows of x (row stride `stride`); cos/sin [T, D].
void rotate_rows(float* x, int64_t stride, const float* cp, const float* snp, int64_t T, int64_t heads, int64_t D);

at::Tensor rotate_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t head_dim);

}  // namespace edgellm::cpu
