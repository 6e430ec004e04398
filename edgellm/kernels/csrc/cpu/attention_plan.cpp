// The work plan of paged decode attention (attn_items) and the merge of a sequence's softmax
// chunks (merge_chunks); attention.h states both.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "vec.h"

namespace edgellm::cpu {

std::vector<AttnItem> attn_items(const int64_t* bt, int64_t MB, const int64_t* sl, int64_t B, int64_t BS,
                                 int64_t Hkv, int64_t window) {
  constexpr int64_t kMinShared = 64;
  const int64_t nth = at::get_num_threads();
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> group_shared;
  std::vector<int64_t> single;
  std::vector<bool> done(B, false);
  for (int64_t b = 0; b < B; ++b) {
    if (done[b]) continue;
    std::vector<int64_t> g{b};
    int64_t blocks = MB;
    for (int64_t c = b + 1; c < B && window <= 0; ++c) {
      if (done[c] || bt[c * MB] != bt[b * MB]) continue;
      const int64_t full = std::min(sl[b], sl[c]) / BS;  // blocks wholly inside both contexts
      int64_t j = 0;
      while (j < full && bt[c * MB + j] == bt[b * MB + j]) ++j;
      if (j * BS < kMinShared) continue;
      g.push_back(c);
      blocks = std::min(blocks, j);
    }
    if (g.size() < 2) {
      single.push_back(b);
      continue;
    }
    for (int64_t c : g) done[c] = true;
    groups.push_back(g);
    group_shared.push_back(blocks * BS);
  }
  std::vector<AttnItem> items;
  const int64_t hpi = static_cast<int64_t>(single.size()) >= 2 * nth ? Hkv : 1;
  for (int64_t b : single) {
    const int64_t n = window > 0 ? std::min(sl[b], window) : sl[b];
    const int64_t nck = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < nck; ++c)
      for (int64_t h0 = 0; h0 < Hkv; h0 += hpi) items.push_back({{b}, h0, hpi, 0, nck > 1 ? c : -1});
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t M = static_cast<int64_t>(groups[i].size());
    const int64_t want = (2 * nth + Hkv * static_cast<int64_t>(groups.size()) - 1) /
                         (Hkv * static_cast<int64_t>(groups.size()));
    const int64_t chunks = std::max<int64_t>(1, std::min(M, want));
    for (int64_t c = 0; c < chunks; ++c) {
      std::vector<int64_t> part(groups[i].begin() + c * M / chunks, groups[i].begin() + (c + 1) * M / chunks);
      for (int64_t h0 = 0; h0 < Hkv; ++h0) items.push_back({part, h0, 1, group_shared[i]});
    }
  }
  return items;
}

void merge_chunks(const float* part, int64_t part_stride, const float* lse, int64_t lse_stride, int64_t nck,
                  int64_t D, float* out) {
  float top = lse[0];
  for (int64_t c = 1; c < nck; ++c) top = std::max(top, lse[c * lse_stride]);
  std::vector<float> w(nck);
  float sum = 0.f;
  for (int64_t c = 0; c < nck; ++c) sum += w[c] = std::exp(lse[c * lse_stride] - top);
  for (int64_t c = 0; c < nck; ++c) w[c] /= sum;
  int64_t d = 0;
#if defined(EDGELLM_V16)
  for (; d + 16 <= D; d += 16) {
    V16 acc = v16_mul(v16_set1(w[0]), v16_load(part + d));
    for (int64_t c = 1; c < nck; ++c) acc = v16_fmadd(v16_set1(w[c]), v16_load(part + c * part_stride + d), acc);
    v16_store(out + d, acc);
  }
#endif
  for (; d < D; ++d) {
    float acc = w[0] * part[d];
    for (int64_t c = 1; c < nck; ++c) acc = std::fma(w[c], part[c * part_stride + d], acc);
    out[d] = acc;
  }
}

}  // namespace edgellm::cpu
