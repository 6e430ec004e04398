// Attention over a shared prefix from bf16 queries and keys: fp32 scores, their softmax numerators
// in bf16 for the product with the values (prefix_softmax.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace edgellm::cpu {

// For q [B, M, D] and k [B, N, D] bf16 (D even), per batch b and query row m:
//   s[n] = scale * q[b, m] . k[b, n]  in fp32 (each product of two bf16 values is exact in fp32 and
//          the sums run in fp32: (q.float() @ k.float().T) * scale up to summation order),
//   mx = max_n s[n], p[b, m, n] = bf16(exp(s[n] - mx)), l[b, m] = sum_n exp(s[n] - mx) (in fp32,
//   before the rounding), mx[b, m].
// Returns (p [B, M, N] bf16, mx [B, M] fp32, l [B, M] fp32): softmax(s) = p / l, and the
// logsumexp is mx + log l. What torch's bf16 matmul cannot give on CPU: it rounds s to bf16.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prefix_softmax_bf16(const at::Tensor& q, const at::Tensor& k,
                                                                   double scale);

}  // namespace edgellm::cpu
