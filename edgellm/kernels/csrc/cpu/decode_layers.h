// The fused decode pass over all decoder layers (decode_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

namespace edgellm::cpu {

// The per-layer layout (models/fused_decode.py builds it; layout() reports these so that Python
// checks it against its own at load). One linear is LINEAR_TENSORS tensors (a, b, c, dense, bias)
// and LINEAR_META ints (kind, group, max_rows, out_features, amx_rows, zero):
//   kind 0: dense only (fp32, or bf16 plain / oneDNN-blocked);
//   kind 1: torch's int4 GEMV up to max_rows rows (a: packed, b: scale_zero; group: its group);
//   kind 2: int4 integer dots up to max_rows rows (a: qweight, b: scale, c: offset; qgemm.h),
//           the dense matrix beyond when given;
//   kind 3: the same with int8 codes (no offset);
//   kinds 4, 5: kinds 2, 3 in the n16 layout (qgemm_n16.h: a, b, c as int_linear_n16 takes
//           them; out_features its n, AMX tiles from amx_rows rows, zero its zero).
// out_features, amx_rows and zero are 0 for kinds 0-3.
constexpr int64_t LINEAR_DENSE = 0, LINEAR_TINYGEMM = 1, LINEAR_INT_DOT = 2, LINEAR_INT8_DOT = 3,
                  LINEAR_INT_N16 = 4, LINEAR_INT8_N16 = 5;
constexpr int64_t LINEAR_TENSORS = 5, LINEAR_META = 6;
// input norm, q norm, k norm, qkv, o, attention output norm, MLP input norm, gate_up, down, MLP
// output norm, kv cache (a norm that is an empty tensor is absent)
constexpr int64_t PER_LAYER = 3 + 2 * LINEAR_TENSORS + 2 + 2 * LINEAR_TENSORS + 1 + 1;
// the 4 linears', then the sliding window, then the rotary (0: cos/sin, 1: local_cos/local_sin,
// -1: none)
constexpr int64_t META_PER_LAYER = 4 * LINEAR_META + 2;
constexpr int64_t ACT_SILU = 0, ACT_GELU_TANH = 1;  // the gated MLP's activation

// One decode-only step through all layers. x [B, H] fp32 (embeddings in, hidden states out, updated
// in place); cos/sin [B, D] fp32 (neox halves); slots [B] int64 (where each token's K/V go);
// local_cos/local_sin: a second table (Gemma 3's sliding layers) or empty; block_tables [B, MB]
// int64; seq_lens [B] int64; window_slots [B] int64 and window_tables [B, MB'] int64: where the
// sliding-window layers' K/V go and are read when their caches are a pool of their own
// (edgellm/engine/window_blocks.py), or both empty. Per layer, PER_LAYER tensors in `w`: input norm weight (absent:
// the attention reads x), q and k norm weights ([D], over each head before rotary), qkv
// (LINEAR_TENSORS), o, the attention output's norm, the MLP input's norm, gate_up, down, the MLP
// output's norm, the kv cache; with META_PER_LAYER ints in `meta`: qkv, o, gate_up, down
// (LINEAR_META each), the sliding window (<= 0: none), the rotary. A layer is
//   x += onorm(o(attn(rotary(qknorm(qkv(inorm(x))))))); x += mnorm(down(act(gate) * up)(pnorm(x)))
// with every norm RMSNorm(eps) whose weight already holds any offset (Gemma's 1 + w).
at::Tensor decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
                         at::Tensor local_sin, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor window_slots, at::Tensor window_tables, std::vector<at::Tensor> w, std::vector<int64_t> meta, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
                         int64_t activation, std::vector<double> kv_scales);

// {PER_LAYER, META_PER_LAYER, LINEAR_TENSORS, LINEAR_META, then the six kinds, the two activations}
std::vector<int64_t> layout();

}  // namespace edgellm::cpu
