// Shared-prefix ("cascade") prefill attention in one pass per query row (cascade_attention.cpp),
// with bf16 products (vdpbf16ps on CPUs with AVX512-BF16, elsewhere the same arithmetic in scalar
// code) or in fp32 (FMA on AVX2 and AVX-512).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace edgellm::cpu {

// Prefill chunks c = 0 .. C - 1 whose first `prefix` keys are the same cached blocks (the first
// prefix / BS entries of tables[0] are read for all of them) and lie wholly before each chunk's
// first query. Chunk c's queries are the rows q_start[c] .. q_start[c + 1] of q [N, Hq, D] (fp32;
// heads and dims contiguous, any token stride), at positions ctx[c] - T_c .. ctx[c] - 1 (T_c its row
// count); each sees keys 0 .. its own position from kv_cache [2, NB, BS, Hkv, D] (fp32 or fp16 pages)
// through its table row (int64 [C, W]), query head j reading kv head j / (Hq / Hkv).
// Per query row and head, with b = bf16 rounding to nearest even when bf16, else the identity:
//   s[n] = scale * b(q) . b(k[n])  (fp32 sums; a product of two bf16 values is exact in fp32),
//   e[n] = exp(s[n] - max s),  l = sum e (fp32),
//   out = sum_n b(e[n]) * b(v[n]) / l  (fp32 sums),
// i.e. softmax attention with bf16 operands and probabilities as a bf16 flash kernel computes it,
// or in fp32. Needs D of 64, 96, 128 or 256, prefix > 0 a multiple of 16 and of BS. Returns out
// [N, Hq, D] fp32.
at::Tensor cascade_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                             const std::vector<int64_t>& ctx, const std::vector<int64_t>& q_start, int64_t prefix,
                             double scale, bool bf16);

}  // namespace edgellm::cpu
