// Paged decode attention (attention.cpp), for the decode_attention op and the fused decode pass
// (decode_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

namespace edgellm::cpu {

// A sequence's softmax runs over chunks of kChunk context tokens (from its window's start), each
// with its own max and sum, merged at the end by their log-sum-exps (merge_chunks): the chunks of
// a long context can then run on different threads (flash-decoding), and since the chunks are
// fixed by the sequence's own length, its result is the same whichever way the work is split,
// alone or in any batch. A multiple of 16 (the kernels' token tiles).
constexpr int64_t kChunk = 512;

// Work items of attend(): sequences that share at least kMinShared leading context tokens as the
// same pages (a cached system prompt) go together, one kv head per item, split into enough
// member chunks for the threads, each member's chunks merged inside the item; the rest one
// sequence each (with all its kv heads when there are enough sequences for the threads: its K/V
// tokens are then read as whole contiguous rows), one item per kChunk chunk of its context
// (`chunk`; -1: the whole context, one chunk), merged after all items ran.
struct AttnItem {
  std::vector<int64_t> members;
  int64_t h0, hpi, shared;
  int64_t chunk = -1;
};

// The work items for B sequences' block tables [B, MB] and context lengths (window <= 0: none).
std::vector<AttnItem> attn_items(const int64_t* bt, int64_t MB, const int64_t* sl, int64_t B, int64_t BS,
                                 int64_t Hkv, int64_t window);

// One query head's output from its nck chunks' outputs (each normalized by its own sum; chunk c's
// D floats at part + c * part_stride) and log-sum-exps (lse[c * lse_stride]): the chunks weighted
// by exp(lse_c - max) / sum, in chunk order, into out[0, D).
void merge_chunks(const float* part, int64_t part_stride, const float* lse, int64_t lse_stride, int64_t nck,
                  int64_t D, float* out);

// Decode attention for B sequences, one query token each. q row b at q + b * q_stride (Hq heads of
// D), output row b at out + b * out_stride. K/V pages: kc / vc [NB, BS, Hkv, D] (fp32, fp16, or fp8
// codes with k_mul / v_mul their scales). block tables [B, MB] int64, seq_lens [B] (context incl.
// this token), window <= 0: none. plan: attn_items() for these tables and (window > 0), when the
// caller has it (the same for every layer of a step); nullptr: made here.
// Instantiated for T = float, c10::Half and uint8_t (fp8 e4m3 codes) in attention.cpp.
template <typename T>
void attend(const float* q, int64_t q_stride, float* out, int64_t out_stride, const T* kc, const T* vc, int64_t BS,
            int64_t Hkv, int64_t D, int64_t G, const int64_t* bt, int64_t MB, const int64_t* sl, int64_t B, float sc,
            int64_t window, float k_mul = 1.f, float v_mul = 1.f, const std::vector<AttnItem>* plan = nullptr);

// TORCH_CHECKs on the kernels' inputs: block tables and lengths against a cache of NB blocks of BS
// tokens; the cache's layout and dtype (fp8 e4m3fn only where fp8_ok).
void check_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t B, int64_t NB,
                  int64_t BS);
void check_cache(const at::Tensor& kv_cache, int64_t D, bool fp8_ok = false);

// q [B, Hq, D] fp32; kv_cache [2, NB, BS, Hkv, D] fp32 or fp16; block_tables [B, MB] int64;
// seq_lens [B] int64 (context length, this step's token included); window <= 0: none.
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, int64_t window);

}  // namespace edgellm::cpu
