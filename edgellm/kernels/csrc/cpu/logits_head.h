// The integer-dot logits head for argmax-only rows (logits_head.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>

namespace edgellm::cpu {

// Logits [M, V] fp32 for rows x [M, K] fp32 of which only the argmax is needed, from the head's
// int8 codes [V, K] (a scale per vocabulary row and group of K / G columns, scale [V, G] fp32 or
// fp16) and its fp32 weight [V, K]:
// y = the int8 products (int_linear, bits 8, groups of K / G; or, with codes and scale in the n16
// layout, int_linear_n16 with AMX tiles from amx_rows rows), then per row the window that holds the
// fp32 maximum, half-width B = sigmas * sqrt(|x|^2 err_ms + |x - x_q|^2 w_ms) + max|y| * 1e-5
// (x_q: x as the kernel rounded it; err_ms / w_ms: the largest per-row mean squares of the
// weight's rounding error and of the weight), and every token with y >= max(y) - 2B recomputed
// in fp32 (the whole row when there are more than max_candidates of them). The argmax is the
// fp32 head's; the other logits stay approximate and below the window.
// allowed: empty, or int32 [M, ceil(V / 32)], a grammar's token bitmask per row (bit j of word i:
// token 32 i + j, set = allowed, xgrammar's layout): disallowed logits are -inf, the window is
// around the maximum over the allowed tokens (the bound B as above, from the unmasked logits) and
// only allowed tokens are recomputed, so the masked argmax is the fp32 head's.
at::Tensor int8_argmax_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& weight, double w_ms, double err_ms, double sigmas,
                              int64_t max_candidates, const at::Tensor& allowed, int64_t amx_rows);

}  // namespace edgellm::cpu
