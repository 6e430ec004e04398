// The integer-dot logits head in one call (the contract: logits_head.h). A decode step's head is
// a 28 MB int8 GEMV for SmolLM2; done as torch ops around it, the window and the candidates cost
// another ~1 ms (a dozen passes over the 49152 logits, each forking the threads), here one pass
// per row (the rows over the threads when there are at least as many rows as threads).
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
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Whether token v is allowed by the row's bitmask words bm (xgrammar's layout).
inline bool allowed_bit(const int32_t* bm, int64_t v) {
  return ((static_cast<uint32_t>(bm[v >> 5]) >> (v & 31)) & 1u) != 0;
}

// A stretch of one row: its max and min (the bound's fp32 noise term) and, with a bitmask, the
// maximum over the allowed tokens, the disallowed ones set to -inf. A NaN never becomes the max.
struct Extremes {
  float hi = kNegInf, lo = -kNegInf, mhi = kNegInf;
  void merge(const Extremes& o) {
    hi = std::max(hi, o.hi), lo = std::min(lo, o.lo), mhi = std::max(mhi, o.mhi);
  }
};

Extremes scan(float* ym, int64_t v0, int64_t v1, const int32_t* bm) {
  Extremes e;
  int64_t v = v0;
  if (bm == nullptr) {
#if defined(EDGELLM_V16)
    V16 h = v16_set1(kNegInf), l = v16_set1(-kNegInf);
    for (; v + 16 <= v1; v += 16) {  // max(y, acc): a NaN y leaves acc, as std::max(acc, y) does
      const V16 y = v16_load(ym + v);
      h = v16_max(y, h);
      l = v16_min(y, l);
    }
    e.hi = v16_hmax(h);
    e.lo = -v16_hmax(v16_sub(v16_zero(), l));
#endif
    for (; v < v1; ++v) e.hi = std::max(e.hi, ym[v]), e.lo = std::min(e.lo, ym[v]);
    e.mhi = e.hi;
    return e;
  }
  for (; v < v1; ++v) {
    e.hi = std::max(e.hi, ym[v]);
    e.lo = std::min(e.lo, ym[v]);
    if (allowed_bit(bm, v)) e.mhi = std::max(e.mhi, ym[v]);
    else ym[v] = kNegInf;
  }
  return e;
}

// The tokens with ym[v] >= floor, in order (-inf, disallowed, is below any finite floor).
void candidates(const float* ym, int64_t V, float floor, std::vector<int64_t>& out) {
  int64_t v = 0;
#if defined(EDGELLM_V16)
  for (; v + 64 <= V; v += 64) {  // skip 64 at a time: candidates are few
    const V16 top = v16_max(v16_max(v16_load(ym + v), v16_load(ym + v + 16)),
                            v16_max(v16_load(ym + v + 32), v16_load(ym + v + 48)));
    if (v16_hmax(top) < floor) continue;
    for (int64_t u = v; u < v + 64; ++u)
      if (ym[u] >= floor) out.push_back(u);
  }
#endif
  for (; v < V; ++v)
    if (ym[v] >= floor) out.push_back(v);
}

}  // namespace

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
  TORCH_CHECK(scale.dim() >= 2 && scale.size(1) > 0 && K % scale.size(1) == 0,
              "scale: one per group of K / G columns ([V, G], or the n16 layout of it)");
  const int64_t group = K / scale.size(1);
  pybind11::gil_scoped_release no_gil;
  const at::Tensor none = at::empty({0}, x.options());
  at::Tensor logits = n16 ? int_linear_n16(x, codes, scale, none, 8, group, none, V, amx_rows)
                          : int_linear(x, codes, scale, none, 8, group, none);
  if (M == 0) return logits;
  const std::vector<at::Tensor> q = quantize_rows(x, K);
  const int8_t* a = q[0].data_ptr<int8_t>();
  const float* d = q[1].data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* y = logits.data_ptr<float>();
  const int32_t* bits = masked ? allowed.data_ptr<int32_t>() : nullptr;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  // Row m after its int8 products: the window around its (masked) maximum and the fp32 recheck
  // of the tokens in it. `threads`: the row's passes go over the threads (few rows), else the
  // whole row runs on the calling thread (the rows go over the threads). Either way the same
  // values: max and min do not depend on the order, and each candidate is one dot.
  auto finish_row = [&](int64_t m, bool threads) {
    float* ym = y + m * V;
    const float* xm = xp + m * K;
    const int32_t* bm = masked ? bits + m * W : nullptr;
    Extremes e;
    if (threads) {  // chunks are whole bitmask words
      std::vector<Extremes> part(nth);
      at::parallel_for(0, W, 128, [&](int64_t w0, int64_t w1) {
        part[at::get_thread_num()].merge(scan(ym, w0 * 32, std::min(V, w1 * 32), bm));
      });
      for (const Extremes& p : part) e.merge(p);
    } else {
      e = scan(ym, 0, V, bm);
    }
    if (e.mhi == kNegInf) return;  // nothing allowed: the row stays -inf
    double xx = 0.0, ee = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double err = xm[k] - static_cast<double>(a[m * K + k]) * d[m * (K / 32) + k / 32];
      xx += static_cast<double>(xm[k]) * xm[k];
      ee += err * err;
    }
    const float bound = static_cast<float>(sigmas * std::sqrt(xx * err_ms + ee * w_ms)) +
                        std::max(e.hi, -e.lo) * 1e-5f;
    std::vector<int64_t> cand;
    candidates(ym, V, e.mhi - 2 * bound, cand);
    if (static_cast<int64_t>(cand.size()) > max_candidates) {
      const at::Tensor row = at::linear(x.narrow(0, m, 1), weight);
      const float* r = row.data_ptr<float>();
      for (int64_t v = 0; v < V; ++v)
        ym[v] = (bm == nullptr || allowed_bit(bm, v)) ? r[v] : kNegInf;
      return;
    }
    auto recheck = [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) ym[cand[c]] = dot(xm, wp + cand[c] * K, K);
    };
    const int64_t n = static_cast<int64_t>(cand.size());
    if (threads) at::parallel_for(0, n, 64, recheck);
    else recheck(0, n);
  };
  if (M >= nth) {  // (one thread: the rows in turn, no region per pass)
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) finish_row(m, false);
    });
  } else {
    for (int64_t m = 0; m < M; ++m) finish_row(m, true);
  }
  return logits;
}

}  // namespace edgellm::cpu
