// Causal prefill attention in fp32 over the paged KV cache (prefill_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace edgellm::cpu {

// One prefill chunk's causal attention, its K/V read from the pages it was just written to.
// q [T, Hq, D] fp32 (heads and dims contiguous, any token stride): the chunk's queries, at context
// positions ctx - T .. ctx - 1. kv_cache [2, NB, BS, Hkv, D] fp32 or fp16 (BS a multiple of 16); table
// [>= ceil(ctx / BS)] int64: the sequence's pages. The query at position p attends keys
// key_start .. p (key_start a multiple of 16, <= ctx - T; GQA: q head h reads kv head h / (Hq / Hkv)).
// Returns (out [T, Hq, D] fp32, lse [T, Hq] fp32: the log of each row's softmax denominator over
// scale * q.k, as a flash kernel's logsumexp).
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                                     const at::Tensor& table, int64_t ctx, int64_t key_start,
                                                     double scale);

// Many chunks in one call (one parallel region: a step's prefill chunks, or each chunk's suffix
// of a shared-prefix step): chunk c's queries are rows q_start[c] .. q_start[c + 1] of q
// [N, Hq, D], at context positions ctx[c] - T .. ctx[c] - 1 (T its row count), its pages row c of
// tables [chunks, W] int64, its keys from key_start[c]; each as prefill_attention above.
// Returns (out [N, Hq, D], lse [N, Hq]).
std::tuple<at::Tensor, at::Tensor> prefill_attention_many(const at::Tensor& q, const at::Tensor& kv_cache,
                                                          const at::Tensor& tables, const std::vector<int64_t>& ctx,
                                                          const std::vector<int64_t>& q_start,
                                                          const std::vector<int64_t>& key_start, double scale);

// The checks both prefill ops over pages make (prefill_attention_many, cascade_attention): q
// [N, Hq, D] fp32, heads and dims contiguous; kv_cache [2, NB, BS, Hkv, D] fp32 or fp16,
// contiguous, its heads dividing Hq, D of 64, 96, 128 or 256; one ctx per chunk and q_start
// [0, .., N]; every chunk has rows, at most ctx of them; tables int64 [chunks, W], rows contiguous,
// row c covering ctx[c] keys with its entries from block key_from[c] / BS on inside the cache.
void check_paged_chunks(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                        const std::vector<int64_t>& ctx, const std::vector<int64_t>& q_start,
                        const std::vector<int64_t>& key_from);

}  // namespace edgellm::cpu
