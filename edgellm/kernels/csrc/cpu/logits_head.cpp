// The integer-dot logits head in one call (the contract: logits_head.h). A decode step's head is
// a 28 MB int8 GEMV for SmolLM2; done as torch ops around it, the window and the candidates cost
// another ~1 ms (a dozen passes over the 49152 logits, each forking the threads), here one pass.
#include "logits_head.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "qgemm.h"
#include "qgemm_n16.h"
#include "vec.h"

namespace edgellm::cpu {

at::Tensor int8_argmax_logits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                              const at::Tensor& weight, double w_ms, double err_ms, double sigmas,
                              int64_t max_candidates, const at::Tensor& allowed, int64_t amx_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] fp32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), V = weight.size(0);
  const bool n16 = codes.dim() == 3;
  TORCH_CHECK(n16 || (codes.dim() == 2 && codes.size(0) == V && codes.size(1) == K && codes.scalar_type() == at::kChar),
              "codes: [V, K] int8 or the n16 layout of them");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight: [V, K] fp32, contiguous");
  const bool masked = allowed.numel() > 0;
  const int64_t W = (V + 31) / 32;
  TORCH_CHECK(!masked || (allowed.dim() == 2 && allowed.size(0) == M && allowed.size(1) == W &&
                          allowed.scalar_type() == at::kInt && allowed.is_contiguous()),
              "allowed: empty or [M, ceil(V / 32)] int32, contiguous");
  pybind11::gil_scoped_release no_gil;
  const at::Tensor none = at::empty({0}, x.options());
  at::Tensor logits = n16 ? int_linear_n16(x, codes, scale, none, 8, K, none, V, amx_rows)
                          : int_linear(x, codes, scale, none, 8, K, none);
  if (M == 0) return logits;
  const std::vector<at::Tensor> q = quantize_rows(x, K);
  const int8_t* a = q[0].data_ptr<int8_t>();
  const float* d = q[1].data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* y = logits.data_ptr<float>();
  const int32_t* bits = masked ? allowed.data_ptr<int32_t>() : nullptr;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < M; ++m) {
    float* ym = y + m * V;
    const float* xm = xp + m * K;
    const int32_t* bm = masked ? bits + m * W : nullptr;
    auto ok = [bm](int64_t v) { return ((static_cast<uint32_t>(bm[v >> 5]) >> (v & 31)) & 1u) != 0; };
    // the row's max and min (unmasked: the bound's fp32 noise term), and the masked maximum with
    // the disallowed logits set to -inf, over the threads; chunks are whole bitmask words
    std::vector<float> hi(nth, kNegInf), lo(nth, -kNegInf), mhi(nth, kNegInf);
    at::parallel_for(0, W, 128, [&](int64_t w0, int64_t w1) {
      const int64_t t = at::get_thread_num();
      float h = hi[t], l = lo[t], mh = mhi[t];
      for (int64_t v = w0 * 32, end = std::min(V, w1 * 32); v < end; ++v) {
        h = std::max(h, ym[v]);
        l = std::min(l, ym[v]);
        if (masked) {
          if (ok(v)) mh = std::max(mh, ym[v]);
          else ym[v] = kNegInf;
        }
      }
      hi[t] = h, lo[t] = l, mhi[t] = mh;
    });
    const float top = *std::max_element(hi.begin(), hi.end());
    const float bottom = *std::min_element(lo.begin(), lo.end());
    const float mtop = masked ? *std::max_element(mhi.begin(), mhi.end()) : top;
    if (mtop == kNegInf) continue;  // nothing allowed: the row stays -inf
    double xx = 0.0, ee = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double e = xm[k] - static_cast<double>(a[m * K + k]) * d[m * (K / 32) + k / 32];
      xx += static_cast<double>(xm[k]) * xm[k];
      ee += e * e;
    }
    const float bound = static_cast<float>(sigmas * std::sqrt(xx * err_ms + ee * w_ms)) +
                        std::max(top, -bottom) * 1e-5f;
    const float floor = mtop - 2 * bound;
    std::vector<int64_t> cand;
    for (int64_t v = 0; v < V; ++v)
      if (ym[v] >= floor) cand.push_back(v);  // -inf (disallowed) is below any finite floor
    if (static_cast<int64_t>(cand.size()) > max_candidates) {
      const at::Tensor row = at::linear(x.narrow(0, m, 1), weight);
      const float* r = row.data_ptr<float>();
      for (int64_t v = 0; v < V; ++v) ym[v] = (!masked || ok(v)) ? r[v] : kNegInf;
      continue;
    }
    at::parallel_for(0, static_cast<int64_t>(cand.size()), 64, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) ym[cand[c]] = dot(xm, wp + cand[c] * K, K);
    });
  }
  return logits;
}

}  // namespace edgellm::cpu
