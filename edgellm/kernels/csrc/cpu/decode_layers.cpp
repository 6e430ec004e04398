// A decode-only step (one token per sequence) through every decoder layer in one call: RMSNorm,
// the matmuls (the same ATen ops the Python path calls), rotary, the K/V write, the attention,
// SiLU-and-mul and both residual adds (see edgellm/kernels/cpu_native.py).
#include "decode_layers.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <pybind11/pybind11.h>
#include <algorithm>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <string>
#include <vector>

#include "attention.h"
#include "qgemm.h"
#include "qgemm_n16.h"
#include "norm.h"
#include "rotary.h"
#include "vec.h"

namespace edgellm::cpu {

// y = x W^T for a bf16 weight in oneDNN's blocked layout (edgellm/quant/backends.pack_bf16): the op the
// Python path calls, through the dispatcher (it has no C++ API of its own).
static at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// y = x W^T (+ bias) for one linear laid out as decode_layers.h says (t: its LINEAR_TENSORS
// tensors, m: its LINEAR_META ints). Empty tensors mean "absent".
static at::Tensor linear(const at::Tensor& x, const at::Tensor* t, const int64_t* m) {
  const at::Tensor &a = t[0], &b = t[1], &c = t[2], &dense = t[3], &bias = t[4];
  const int64_t kind = m[0], group = m[1], max_rows = m[2];
  const bool small = x.size(0) <= max_rows;
  if ((kind == LINEAR_INT_DOT || kind == LINEAR_INT8_DOT) && (small || dense.numel() == 0)) {
    return int_linear(x.contiguous(), a, b, c, kind == LINEAR_INT8_DOT ? 8 : 4, group, bias);
  }
  if ((kind == LINEAR_INT_N16 || kind == LINEAR_INT8_N16) && (small || dense.numel() == 0)) {
    // int8 kinds in the n16 layout may hold narrow codes: the block size says how many bits
    const int64_t bits = kind == LINEAR_INT_N16 ? 4 : n16_int8_bits(a.size(2));
    return int_linear_n16(x.contiguous(), a, b, c, bits, group, bias, m[3], m[4], m[5]);
  }
  at::Tensor y;
  if (kind == LINEAR_TINYGEMM && small) {
    y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), a, group, b).to(at::kFloat);
  } else if (dense.is_mkldnn()) {
    y = packed_linear(x.to(at::kBFloat16), dense).to(at::kFloat);
  } else if (dense.scalar_type() == at::kBFloat16) {
    y = at::linear(x.to(at::kBFloat16), dense).to(at::kFloat);
  } else {
    y = at::linear(x, dense);
  }
  if (bias.numel() > 0) y.add_(bias);
  return y;
}

// n values of this step's K or V into the cache as its dtype: fp32 as they are, fp16 rounded to
// nearest even, fp8 as edgellm/kernels/paged_attention.write_kv_ref does (clamp(x / scale, +-448),
// rounded to e4m3). The fp32 and fp16 caches hold unscaled values (scale 1).
static void put_row(const float* x, float* y, int64_t n, float) { std::copy(x, x + n, y); }
static void put_row(const float* x, c10::Half* y, int64_t n, float) { to_half(x, y, n); }
static void put_row(const float* x, uint8_t* y, int64_t n, float scale) {
  for (int64_t j = 0; j < n; ++j) y[j] = c10::Float8_e4m3fn(std::min(std::max(x[j] / scale, -448.f), 448.f)).x;
}

std::vector<int64_t> layout() {
  return {PER_LAYER, META_PER_LAYER, LINEAR_TENSORS, LINEAR_META,
          LINEAR_DENSE, LINEAR_TINYGEMM, LINEAR_INT_DOT, LINEAR_INT8_DOT, LINEAR_INT_N16, LINEAR_INT8_N16,
          ACT_SILU, ACT_GELU_TANH};
}

// RMSNorm of each of `rows` rows of `n` floats, `stride` apart, in place; absent weight: nothing.
static void norm_rows(float* x, int64_t stride, int64_t rows, int64_t n, const at::Tensor& weight, float eps) {
  if (weight.numel() == 0) return;
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == at::kFloat, "norm weight");
  const float* wp = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rmsnorm(x + r * stride, wp, x + r * stride, n, eps);
}

// One decode-only step through all layers (declared, with the per-layer tensors, in decode_layers.h).
at::Tensor decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor local_cos,
                         at::Tensor local_sin, at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor window_slots, at::Tensor window_tables, std::vector<at::Tensor> w, std::vector<int64_t> meta, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
                         int64_t activation, std::vector<double> kv_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [B, H] fp32");
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  TORCH_CHECK(w.size() % PER_LAYER == 0 && meta.size() == w.size() / PER_LAYER * META_PER_LAYER, "per-layer tensors");
  const int64_t B = x.size(0), H = x.size(1), D = head_dim, Hq = num_heads, Hkv = num_kv_heads;
  const int64_t G = Hq / Hkv, QKV = (Hq + 2 * Hkv) * D, I = intermediate;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D, "cos/sin [B, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B, "slots: [B] int64");
  const int64_t L = w.size() / PER_LAYER;
  if (B == 0 || L == 0) return x;
  TORCH_CHECK(kv_scales.size() == 2 * static_cast<size_t>(w.size() / PER_LAYER), "two kv scales per layer");
  // pool 0: every layer's pages, or the global layers' when pool 1 (the window layers') is given
  const bool pooled = window_tables.numel() > 0;
  TORCH_CHECK(!pooled || (window_slots.scalar_type() == at::kLong && window_slots.numel() == B),
              "window_slots: [B] int64");
  const at::Tensor pool_slots[2] = {slots, pooled ? window_slots : slots};
  const at::Tensor pool_tables[2] = {block_tables, pooled ? window_tables : block_tables};
  int64_t NB[2] = {-1, -1}, BS = -1;
  for (int64_t l = 0; l < L; ++l) {  // every pool's caches agree on their shape; tables and slots fit them
    const at::Tensor& cache = w[l * PER_LAYER + PER_LAYER - 1];
    check_cache(cache, D, true);
    const int p = pooled && meta[l * META_PER_LAYER + 4 * LINEAR_META] > 0 ? 1 : 0;
    TORCH_CHECK(cache.size(3) == Hkv && Hq % Hkv == 0, "kv heads");
    TORCH_CHECK(BS < 0 || cache.size(2) == BS, "kv caches differ in block size");
    TORCH_CHECK(NB[p] < 0 || cache.size(1) == NB[p], "kv caches of one pool differ");
    BS = cache.size(2);
    if (NB[p] < 0) {
      NB[p] = cache.size(1);
      check_tables(pool_tables[p], seq_lens, B, NB[p], BS);
      const int64_t* sp = pool_slots[p].data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < NB[p] * BS, "slot out of the cache");
    }
  }
  const bool local = local_cos.numel() > 0;
  TORCH_CHECK(!local || (local_cos.is_contiguous() && local_sin.is_contiguous() && local_cos.numel() == B * D &&
                         local_sin.numel() == B * D), "local cos/sin [B, D]");
  TORCH_CHECK(activation == ACT_SILU || activation == ACT_GELU_TANH, "activation");
  const float* tables[2][2] = {{cos.data_ptr<float>(), sin.data_ptr<float>()},
                               {local ? local_cos.data_ptr<float>() : nullptr,
                                local ? local_sin.data_ptr<float>() : nullptr}};
  const float epsf = static_cast<float>(eps);
  float* xp = x.data_ptr<float>();
  auto h = at::empty_like(x);
  auto attn = at::empty({B, Hq * D}, x.options());
  // the attention's work items depend on the tables and on whether a layer has a window: made
  // once per step (index 0: no window, 1: windowed), not once per layer; a windowed layer reads
  // pool 1's tables when the pools are apart
  std::vector<AttnItem> plans[2];
  bool planned[2] = {false, false};
  auto plan_for = [&](int64_t window) -> const std::vector<AttnItem>* {
    const int k = window > 0 ? 1 : 0;
    if (!planned[k]) {
      const at::Tensor& bt = pool_tables[pooled ? k : 0];
      plans[k] = attn_items(bt.data_ptr<int64_t>(), bt.size(1), seq_lens.data_ptr<int64_t>(), B, BS, Hkv, window);
      planned[k] = true;
    }
    return &plans[k];
  };
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* t = w.data() + l * PER_LAYER;
    const int64_t* m = meta.data() + l * META_PER_LAYER;
    const int64_t window = m[4 * LINEAR_META], which = m[4 * LINEAR_META + 1];
    TORCH_CHECK(which == -1 || which == 0 || (which == 1 && local), "rotary table");
    const at::Tensor& cache = t[PER_LAYER - 1];
    const int pool = pooled && window > 0 ? 1 : 0;
    const int64_t nb = NB[pool];
    const int64_t* sp = pool_slots[pool].data_ptr<int64_t>();
    const at::Tensor& tables_l = pool_tables[pool];
    const at::Tensor *qkv_w = t + 3, *o_w = qkv_w + LINEAR_TENSORS, *gu_w = o_w + LINEAR_TENSORS + 2,
                     *down_w = gu_w + LINEAR_TENSORS;
    const at::Tensor &in_norm = t[0], &q_norm = t[1], &k_norm = t[2], &o_norm = o_w[LINEAR_TENSORS],
                     &mlp_norm = o_w[LINEAR_TENSORS + 1], &out_norm = down_w[LINEAR_TENSORS];
    // attention block
    float* hp = h.data_ptr<float>();
    const bool pre = in_norm.numel() > 0;
    if (pre) {
      std::copy(xp, xp + B * H, hp);
      norm_rows(hp, H, B, H, in_norm, epsf);
    }
    auto qkv = linear(pre ? h : x, qkv_w, m).contiguous();
    TORCH_CHECK(qkv.size(1) == QKV, "qkv width");
    float* qp = qkv.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {  // q/k norms per head, before rotary
      norm_rows(qp + b * QKV, D, Hq, D, q_norm, epsf);
      norm_rows(qp + b * QKV + Hq * D, D, Hkv, D, k_norm, epsf);
    }
    if (which >= 0) rotate_rows(qp, QKV, tables[which][0], tables[which][1], B, Hq + Hkv, D);  // q, then k heads
    // this step's K and V into their slots, then attention over the pages, in the cache's dtype
    auto attention = [&](auto* kc, float k_mul, float v_mul) {
      auto* vc = kc + nb * BS * Hkv * D;
      for (int64_t b = 0; b < B; ++b) {
        put_row(qp + b * QKV + Hq * D, kc + sp[b] * Hkv * D, Hkv * D, k_mul);
        put_row(qp + b * QKV + (Hq + Hkv) * D, vc + sp[b] * Hkv * D, Hkv * D, v_mul);
      }
      attend(qp, QKV, attn.data_ptr<float>(), Hq * D, kc, vc, BS, Hkv, D, G, tables_l.data_ptr<int64_t>(),
             tables_l.size(1), seq_lens.data_ptr<int64_t>(), B, static_cast<float>(scale), window, k_mul, v_mul,
             plan_for(window));
    };
    if (cache.scalar_type() == at::ScalarType::Float8_e4m3fn) {
      attention(reinterpret_cast<uint8_t*>(cache.data_ptr()), static_cast<float>(kv_scales[2 * l]),
                static_cast<float>(kv_scales[2 * l + 1]));
    } else if (cache.scalar_type() == at::kHalf) {
      attention(reinterpret_cast<c10::Half*>(cache.data_ptr()), 1.f, 1.f);
    } else {
      attention(cache.data_ptr<float>(), 1.f, 1.f);
    }
    auto o = linear(attn, o_w, m + LINEAR_META).contiguous();
    float* op = o.data_ptr<float>();
    norm_rows(op, H, B, H, o_norm, epsf);
    for (int64_t i = 0; i < B * H; ++i) xp[i] += op[i];
    // MLP block
    const bool mlp_pre = mlp_norm.numel() > 0;
    if (mlp_pre) {
      std::copy(xp, xp + B * H, hp);
      norm_rows(hp, H, B, H, mlp_norm, epsf);
    }
    auto gu = linear(mlp_pre ? h : x, gu_w, m + 2 * LINEAR_META);
    TORCH_CHECK(gu.size(1) == 2 * I, "gate_up width");
    auto gate = gu.narrow(1, 0, I);
    auto act = (activation == ACT_SILU ? at::silu(gate) : at::gelu(gate, "tanh")).mul_(gu.narrow(1, I, I));
    auto d = linear(act, down_w, m + 3 * LINEAR_META).contiguous();
    float* dp = d.data_ptr<float>();
    norm_rows(dp, H, B, H, out_norm, epsf);
    for (int64_t i = 0; i < B * H; ++i) xp[i] += dp[i];
  }
  return x;
}

}  // namespace edgellm::cpu
