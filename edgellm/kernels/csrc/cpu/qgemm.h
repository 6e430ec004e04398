// Integer-dot matmuls for weight-quantized linears on CPU (qgemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

namespace edgellm::cpu {

// Activations x [M, K] fp32 quantized per row and 32-element block to int8 (the Q8_0 rule:
// d = absmax / 127, a = round-to-nearest-even(x * (1 / d)), |a| <= 127): codes [M, K] int8,
// d [M, K / 32] fp32, and per weight group g (of `group` elements) dsum [M, K / group] =
// sum over the group's blocks of d_b * sum(a_b) (what an offset or zero point multiplies; group 16:
// d_b * the sum over the half block).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t group);

// y [M, N] fp32 = x W^T (+ bias), W given per group g of `group` input columns as
//   bits 4: W[n, k] = scale[n, g] * q[n, k] + offset[n, g], q in 0..15, qweight [N, K / 2] uint8,
//           each 32-column block as 16 bytes, byte j = q[j] | q[j + 16] << 4;
//   bits 8: W[n, k] = scale[n, g] * q[n, k] + offset[n, g], q in -128..127, qweight [N, K] int8.
// scale / offset [N, K / group] fp32 or fp16. Each output is sum_b d_b (scale * dot(q_b, a_b))
// (+ offset * dsum): exact int32 block dots, fp32 scaling; the only error is the activations'
// int8 rounding. group: a multiple of 32 dividing K, or (int8 only) 16, as GGUF's Q6_K / Q3_K /
// Q2_K sub-blocks; K a multiple of 32 either way. offset: empty for none.
// Callable with or without the GIL (it never touches Python); int_linear_op is the Python op,
// which releases the GIL around it.
at::Tensor int_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                      const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias);
at::Tensor int_linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias);

}  // namespace edgellm::cpu
