// Shared-prefix prefill attention in one pass per query row (the contract: cascade_attention.h).
//
// Keys and values are repacked once per call into the layouts the products take (cascade_math.h:
// bf16 pairs for vdpbf16ps, or fp32), the shared prefix's once per kv head and each chunk's own
// keys once per chunk and kv head: keys transposed ([dims][keys], so a score micro-tile of rows x
// 16-key vectors comes from broadcast products, no horizontal sums), values by key ([keys][dims]).
// A task is one chunk, one kv head and 16 query positions (its G query heads' rows, 16 at a time):
// the rows' scores over the prefix and over the chunk's own keys go to one fp32 buffer, each row's
// max, exp and sum are taken over the keys it sees (the rest weigh 0), its probabilities packed,
// then the values accumulate in registers and the row is divided by its sum. No scores,
// probabilities or partial outputs leave the task, and no log-sum-exp merge is needed: prefix and
// own keys are one softmax.
#include "cascade_attention.h"

#include "cascade_math.h"
#include "prefill_attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace edgellm::cpu {
namespace {

using cascade::KT;
constexpr int64_t ROWS = 16;  // query rows per score buffer
constexpr int64_t BQ = 16;    // query positions per task

float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float top = -INFINITY;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    top = _mm512_reduce_max_ps(v);
  }
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// Keys [k0, k0 + n) of kv head h through one table row into kp [D / PACK][NP] and vp [NP / PACK][D]
// (NP >= n, a multiple of 16; keys past n are 0).
template <class M, typename E>
void repack(const E* kc, const E* vc, const int64_t* table, int64_t BS, int64_t Hkv, int64_t D, int64_t h, int64_t k0,
            int64_t n, int64_t NP, typename M::Word* kp, typename M::Word* vp) {
  std::fill(kp, kp + D / M::PACK * NP, typename M::Word{});
  std::fill(vp, vp + NP / M::PACK * D, typename M::Word{});
  alignas(64) float buf[256];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = k0 + j, slot = (table[pos / BS] * BS + pos % BS) * Hkv + h;
    M::key(load_row(kc + slot * D, buf, D), D, kp, NP, j);
    M::value(load_row(vc + slot * D, buf, D), D, vp, j);
  }
}

template <class M>
struct Plan {
  using Word = typename M::Word;
  const float* q;
  int64_t q_tok, Hq, Hkv, G, D, P;
  float scale;
  const int64_t* q_start;
  const int64_t* ctx;
  const Word* pre;  // per kv head: kp [D / PACK][P], then vp [P / PACK][D]
  const Word* own;  // per chunk, per kv head: kp [D / PACK][Lp], then vp [Lp / PACK][D]
  const int64_t *own_at, *own_len, *own_pad;  // per chunk: offset in own, L = ctx - P, Lp (L rounded up to 16)
  float* out;
  int64_t head_words(int64_t keys) const { return D / M::PACK * keys + keys / M::PACK * D; }  // kp + vp of a head
};

// rows of chunk c, kv head h, query positions [i0, i1)
template <class M, int DC>
void task(const Plan<M>& w, int64_t c, int64_t h, int64_t i0, int64_t i1, std::vector<float>& s,
          std::vector<typename M::Word>& qb, std::vector<typename M::Word>& pb, std::vector<float>& acc) {
  constexpr int64_t D = DC * 16, QW = D / M::PACK;  // words per query row
  const int64_t P = w.P, L = w.own_len[c], Lp = w.own_pad[c], S = P + Lp, nq = i1 - i0;
  const int64_t first = w.ctx[c] - (w.q_start[c + 1] - w.q_start[c]);  // position of the chunk's row 0
  const auto* kp_own = w.own + w.own_at[c] + h * w.head_words(Lp);
  const auto* vp_own = kp_own + QW * Lp;
  s.resize(ROWS * S);
  pb.resize(ROWS * S / M::PACK);
  float l[ROWS];
  for (int64_t r0 = 0; r0 < w.G * nq; r0 += ROWS) {
    const int64_t rows = std::min(ROWS, w.G * nq - r0);
    for (int64_t rr = 0; rr < rows; ++rr) {  // row r: head g = r / nq of the group, position i0 + r % nq
      const int64_t r = r0 + rr, g = r / nq, i = i0 + r % nq;
      M::row(w.q + (w.q_start[c] + i) * w.q_tok + (h * w.G + g) * D, D, qb.data() + rr * QW);
    }
    M::scores(qb.data(), rows, D, w.pre + h * w.head_words(P), P, s.data(), S, w.scale);
    M::scores(qb.data(), rows, D, kp_own, Lp, s.data() + P, S, w.scale);
    int64_t seen_most = 0;
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t pos = first + i0 + (r0 + rr) % nq;
      const int64_t seen = P + std::min(L, pos - P + 1);  // keys 0 .. pos
      float* row = s.data() + rr * S;
      l[rr] = exp_shifted_sum(row, seen, row_max(row, seen));
      std::fill(row + seen, row + S, 0.f);
      M::row(row, S, pb.data() + rr * S / M::PACK);
      seen_most = std::max(seen_most, seen);
    }
    std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
    const int64_t ldP = S / M::PACK;
    M::template values<DC>(pb.data(), ldP, rows, P, w.pre + h * w.head_words(P) + QW * P, acc.data());
    M::template values<DC>(pb.data() + P / M::PACK, ldP, rows, seen_most - P, vp_own, acc.data());
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t r = r0 + rr, g = r / nq, i = i0 + r % nq;
      float* o = w.out + ((w.q_start[c] + i) * w.Hq + h * w.G + g) * D;
      const float inv = 1.f / l[rr];
      for (int64_t d = 0; d < D; ++d) o[d] = acc[rr * D + d] * inv;
    }
  }
}

template <class M, int DC>
void run_tasks(const Plan<M>& w, int64_t C) {
  std::vector<int64_t> tc, th, ti;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < w.Hkv; ++h)
      for (int64_t i = 0; i < w.q_start[c + 1] - w.q_start[c]; i += BQ) {
        tc.push_back(c);
        th.push_back(h);
        ti.push_back(i);
      }
  at::parallel_for(0, static_cast<int64_t>(tc.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s, acc(ROWS * DC * 16);
    std::vector<typename M::Word> qb(ROWS * DC * 16 / M::PACK), pb;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t T = w.q_start[tc[t] + 1] - w.q_start[tc[t]];
      task<M, DC>(w, tc[t], th[t], ti[t], std::min(T, ti[t] + BQ), s, qb, pb, acc);
    }
  });
}

// Repack every head's keys and values, then run the tasks (the op below has checked the shapes).
template <class M, typename E>
void attend(const float* q, int64_t q_tok, const E* kc, const int64_t* tp, int64_t t_stride, int64_t NB, int64_t BS,
            int64_t Hq, int64_t Hkv, int64_t D, int64_t P, const std::vector<int64_t>& ctx,
            const std::vector<int64_t>& q_start, float scale, float* out) {
  const int64_t C = static_cast<int64_t>(ctx.size());
  const E* vc = kc + NB * BS * Hkv * D;
  std::vector<int64_t> own_at(C), own_len(C), own_pad(C);
  int64_t own_total = 0;
  auto head_words = [&](int64_t keys) { return D / M::PACK * keys + keys / M::PACK * D; };
  for (int64_t c = 0; c < C; ++c) {
    own_len[c] = ctx[c] - P;
    own_pad[c] = (own_len[c] + KT - 1) / KT * KT;
    own_at[c] = own_total;
    own_total += Hkv * head_words(own_pad[c]);
  }
  std::vector<typename M::Word> pre(Hkv * head_words(P)), own(own_total);
  at::parallel_for(0, Hkv * (C + 1), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c = u / Hkv - 1, h = u % Hkv;  // c == -1: the shared prefix, through chunk 0's table row
      const int64_t keys = c < 0 ? P : own_pad[c];
      auto* kp = (c < 0 ? pre.data() : own.data() + own_at[c]) + h * head_words(keys);
      repack<M>(kc, vc, tp + std::max<int64_t>(c, 0) * t_stride, BS, Hkv, D, h, c < 0 ? 0 : P,
                c < 0 ? P : own_len[c], keys, kp, kp + D / M::PACK * keys);
    }
  });
  const Plan<M> w{q,           q_tok,         Hq,          Hkv,           Hq / Hkv,       D, P, scale, q_start.data(),
                  ctx.data(),  pre.data(),   own.data(),  own_at.data(), own_len.data(), own_pad.data(), out};
  switch (D / 16) {
    case 4: run_tasks<M, 4>(w, C); break;
    case 6: run_tasks<M, 6>(w, C); break;
    case 8: run_tasks<M, 8>(w, C); break;
    default: run_tasks<M, 16>(w, C); break;
  }
}

}  // namespace

at::Tensor cascade_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                             const std::vector<int64_t>& ctx, const std::vector<int64_t>& q_start, int64_t prefix,
                             double scale, bool bf16) {
  const int64_t C = static_cast<int64_t>(ctx.size()), P = prefix;
  std::vector<int64_t> key_from(C, P);  // chunk 0's row holds the prefix's blocks for every chunk
  if (C > 0) key_from[0] = 0;
  check_paged_chunks(q, kv_cache, tables, ctx, q_start, key_from);
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(P > 0 && P % 16 == 0 && P % BS == 0, "prefix must be a positive multiple of 16 and of the block size");
  for (int64_t c = 0; c < C; ++c)
    TORCH_CHECK(ctx[c] - (q_start[c + 1] - q_start[c]) >= P, "chunk ", c, ": need the prefix wholly before its first query");
  const int64_t* tp = tables.data_ptr<int64_t>();
  auto out = at::empty({N, Hq, D}, q.options());
  pybind11::gil_scoped_release no_gil;
  auto run = [&](auto math, const auto* kc) {
    attend<decltype(math)>(q.data_ptr<float>(), q.stride(0), kc, tp, tables.stride(0), NB, BS, Hq, Hkv, D, P, ctx,
                           q_start, static_cast<float>(scale), out.data_ptr<float>());
  };
  const auto* k16 = reinterpret_cast<const c10::Half*>(kv_cache.data_ptr());  // fp16 pages
  const auto* k32 = reinterpret_cast<const float*>(kv_cache.data_ptr());       // fp32 pages
  const bool half = kv_cache.scalar_type() == at::kHalf;
  if (bf16 && half) run(cascade::Bf16Math{}, k16);
  else if (bf16) run(cascade::Bf16Math{}, k32);
  else if (half) run(cascade::F32Math{}, k16);
  else run(cascade::F32Math{}, k32);
  return out;
}

}  // namespace edgellm::cpu
