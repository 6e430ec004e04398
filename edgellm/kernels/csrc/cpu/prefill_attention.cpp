// Causal prefill attention in fp32 over the paged KV cache (fp32 or fp16 pages) (the contract: prefill_attention.h).
//
// A work item is one chunk, one kv head and BQ query positions, with the G query heads that share
// the kv head (G * BQ rows). It walks the key tiles (64 keys: four sub-tiles of 16, each inside
// one page) up to its last query's position, skipping what the causal mask hides whole. Per tile
// the keys are transposed once ([D][64]), so that RB rows' scores come out of broadcast-FMAs (no
// horizontal sums, the 4 x 4 accumulators in registers, stored once per tile); then per row the
// online softmax (running max and denominator, the accumulator rescaled only when the max grows)
// and the probabilities times the value rows, read in place from the pages.
#include "prefill_attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace edgellm::cpu {
namespace {

#if defined(EDGELLM_V16)
constexpr int64_t SUB = 16;       // keys per sub-tile: one V16 of scores, inside one page
constexpr int NSUB = 4;           // sub-tiles per key tile (the max and sum below name all four): the softmax's per-row work covers 64 keys
constexpr int64_t KT = SUB * NSUB;
constexpr int64_t BQ = 16;        // query positions per work item
#if defined(__AVX512F__)
constexpr int RB = 4;  // rows sharing one pass over a transposed key tile (RB * NSUB zmm accumulators)
#else
constexpr int RB = 1;  // AVX2: NSUB V16 accumulators are already 8 of the 16 ymm registers
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename E>  // the cache's element: float or c10::Half
struct Job {
  const float* q;
  int64_t q_tok;  // floats between tokens of q
  const E* kc;
  const E* vc;
  const int64_t* table;
  int64_t BS, Hkv, Hq, D, G, T, ctx, key_start;
  float scale;
  float* out;  // [T, Hq, D]
  float* lse;  // [T, Hq]
};

// Every row of kv head h and query positions [i0, i1) (chunk-relative). kt: this head's key tiles,
// transposed ([tile][D][KT]; keys past the context are 0).
template <int DC, typename E>
void item(const Job<E>& j, const float* kt, int64_t h, int64_t i0, int64_t i1) {
  constexpr int64_t D = DC * 16;
  constexpr bool JOINT = RB * DC <= 16;  // RB rows' accumulators fit the registers beside V's
  const int64_t nq = i1 - i0, R = j.G * nq, first = j.ctx - j.T;
  const int64_t R_pad = (R + RB - 1) / RB * RB;  // whole groups of RB rows: fixed-size, unrolled loops
  std::vector<float> acc(R_pad * D, 0.f), m(R_pad, NEG_INF), l(R_pad, 0.f);
  const std::vector<float> zeros(D, 0.f);
  std::vector<const float*> qrow(R_pad, zeros.data());
  std::vector<int64_t> qpos(R_pad, -1);
  for (int64_t g = 0; g < j.G; ++g) {
    for (int64_t i = 0; i < nq; ++i) {
      qrow[g * nq + i] = j.q + (i0 + i) * j.q_tok + (h * j.G + g) * D;
      qpos[g * nq + i] = first + i0 + i;
    }
  }
  const int64_t last = first + i1 - 1;
  const int64_t row_stride = j.Hkv * D;  // floats between tokens in a page
  alignas(64) float buf[RB][KT];
  const E* vsub[NSUB];
  for (int64_t kp = j.key_start; kp <= last; kp += KT) {
    const int64_t in_ctx = std::min<int64_t>(KT, j.ctx - kp);
    const float* ktile = kt + (kp - j.key_start) / KT * D * KT;
    for (int sb = 0; sb < NSUB; ++sb) {
      const int64_t pos = std::min(kp + sb * SUB, j.ctx - 1) / SUB * SUB;  // past the context: unread
      vsub[sb] = j.vc + ((j.table[pos / j.BS] * j.BS + pos % j.BS) * j.Hkv + h) * D;
    }
    // every loop below over RB rows or NSUB sub-tiles has a fixed count, so the scores stay in
    // registers; keys a row does not see get probability 0
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      {  // the RB rows' scaled scores into buf: accumulated in registers, stored once per tile
        V16 s[RB][NSUB];
        for (int u = 0; u < RB; ++u) {
          for (int sb = 0; sb < NSUB; ++sb) s[u][sb] = v16_zero();
        }
        for (int64_t d = 0; d < D; ++d) {
          const float* kd = ktile + d * KT;
          V16 qd[RB];
          for (int u = 0; u < RB; ++u) qd[u] = v16_set1(qrow[r0 + u][d]);
          for (int sb = 0; sb < NSUB; ++sb) {
            const V16 kv = v16_load(kd + sb * SUB);
            for (int u = 0; u < RB; ++u) s[u][sb] = v16_fmadd(qd[u], kv, s[u][sb]);
          }
        }
        const V16 sc = v16_set1(j.scale);
        for (int u = 0; u < RB; ++u) {
          for (int sb = 0; sb < NSUB; ++sb) v16_store(buf[u] + sb * SUB, v16_mul(s[u][sb], sc));
        }
      }
      int64_t valid[RB];
      int64_t most = 0;
      float alpha[RB];
      for (int u = 0; u < RB; ++u) {
        const int64_t r = r0 + u;
        valid[u] = std::max<int64_t>(0, std::min<int64_t>(in_ctx, qpos[r] - kp + 1));  // keys seen
        most = std::max(most, valid[u]);
        alpha[u] = 1.f;
        if (valid[u] == 0) {
          for (int64_t t = 0; t < KT; ++t) buf[u][t] = 0.f;
          continue;
        }
        for (int64_t t = valid[u]; t < KT; ++t) buf[u][t] = NEG_INF;
        V16 sv[NSUB];
        for (int sb = 0; sb < NSUB; ++sb) sv[sb] = v16_load(buf[u] + sb * SUB);
        const V16 mx = v16_max(v16_max(sv[0], sv[1]), v16_max(sv[2], sv[3]));
        const float m_new = std::max(m[r], v16_hmax(mx));
        const V16 mv = v16_set1(m_new);
        for (int sb = 0; sb < NSUB; ++sb) v16_store(buf[u] + sb * SUB, exp16(v16_sub(sv[sb], mv)));
        for (int64_t t = valid[u]; t < KT; ++t) buf[u][t] = 0.f;  // exp16 clamps: hidden keys weigh 0
        V16 psum = v16_load(buf[u]);
        for (int sb = 1; sb < NSUB; ++sb) psum = v16_add(psum, v16_load(buf[u] + sb * SUB));
        if (m_new > m[r]) alpha[u] = std::exp(m[r] - m_new);  // 0 on the row's first tile
        l[r] = l[r] * alpha[u] + v16_sum(psum);
        m[r] = m_new;
      }
      if constexpr (JOINT) {  // P.V for the RB rows at once: each value row loaded once
        V16 a[RB][DC];
        for (int u = 0; u < RB; ++u) {
          const float* ar = acc.data() + (r0 + u) * D;
          const V16 av = v16_set1(alpha[u]);
          for (int c = 0; c < DC; ++c) a[u][c] = v16_mul(v16_load(ar + 16 * c), av);
        }
        for (int64_t t = 0; t < most; ++t) {
          const E* vr = vsub[t / SUB] + (t % SUB) * row_stride;
          V16 vv[DC];
          for (int c = 0; c < DC; ++c) vv[c] = load16(vr + 16 * c);
          for (int u = 0; u < RB; ++u) {
            const V16 pt = v16_set1(buf[u][t]);
            for (int c = 0; c < DC; ++c) a[u][c] = v16_fmadd(pt, vv[c], a[u][c]);
          }
        }
        for (int u = 0; u < RB; ++u) {
          float* ar = acc.data() + (r0 + u) * D;
          for (int c = 0; c < DC; ++c) v16_store(ar + 16 * c, a[u][c]);
        }
      } else {
        for (int u = 0; u < RB; ++u) {
          float* ar = acc.data() + (r0 + u) * D;
          V16 a[DC];
          const V16 av = v16_set1(alpha[u]);
          for (int c = 0; c < DC; ++c) a[c] = v16_mul(v16_load(ar + 16 * c), av);
          for (int64_t t = 0; t < valid[u]; ++t) {
            const V16 pt = v16_set1(buf[u][t]);
            const E* vr = vsub[t / SUB] + (t % SUB) * row_stride;
            for (int c = 0; c < DC; ++c) a[c] = v16_fmadd(pt, load16(vr + 16 * c), a[c]);
          }
          for (int c = 0; c < DC; ++c) v16_store(ar + 16 * c, a[c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < j.G; ++g) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t r = g * nq + i, head = h * j.G + g;
      const float inv = 1.f / l[r];
      float* o = j.out + ((i0 + i) * j.Hq + head) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      j.lse[(i0 + i) * j.Hq + head] = m[r] + std::log(l[r]);
    }
  }
}

// The 64-key tile of kv head h from position kp, transposed into out ([D][KT]; keys past the
// context are 0; fp16 keys as fp32).
template <int DC, typename E>
void transpose_tile(const Job<E>& j, int64_t h, int64_t kp, float* out) {
  constexpr int64_t D = DC * 16;
  float row[D];
  for (int64_t t = 0; t < KT; ++t) {
    const int64_t pos = kp + t;
    if (pos >= j.ctx) {
      for (int64_t d = 0; d < D; ++d) out[d * KT + t] = 0.f;
      continue;
    }
    const float* kr = load_row(j.kc + ((j.table[pos / j.BS] * j.BS + pos % j.BS) * j.Hkv + h) * D, row, D);
    for (int64_t d = 0; d < D; ++d) out[d * KT + t] = kr[d];
  }
}

// Every chunk's items in one parallel region. The keys of each chunk are transposed first (one
// region over (chunk, kv head, tile)); then the items (chunk, kv head, query block) are split over
// torch's threads by their cost (the key tiles they read), so neither the causal triangle's long
// rows nor one long chunk among short ones lands on one thread.
template <int DC, typename E>
void run(const std::vector<Job<E>>& jobs) {
  constexpr int64_t D = DC * 16;
  struct Item {
    int64_t job, h, i0, i1;
  };
  std::vector<Item> items;
  std::vector<int64_t> cost_end;  // running sum of key tiles read, items in order
  std::vector<int64_t> tiles_of(jobs.size()), tile_base(jobs.size() + 1, 0);
  int64_t total = 0;
  for (size_t c = 0; c < jobs.size(); ++c) {
    const Job<E>& j = jobs[c];
    const int64_t nqb = (j.T + BQ - 1) / BQ, first = j.ctx - j.T;
    tiles_of[c] = (j.ctx - j.key_start + KT - 1) / KT;
    tile_base[c + 1] = tile_base[c] + j.Hkv * tiles_of[c];
    for (int64_t h = 0; h < j.Hkv; ++h) {
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const int64_t i1 = std::min(j.T, (qb + 1) * BQ);
        total += (first + i1 - 1 - j.key_start) / KT + 1;
        items.push_back({static_cast<int64_t>(c), h, qb * BQ, i1});
        cost_end.push_back(total);
      }
    }
  }
  // the key tiles of every chunk and kv head, transposed once for all the query blocks that read them
  std::vector<float> kt(tile_base.back() * D * KT);
  at::parallel_for(0, tile_base.back(), 1, [&](int64_t w0, int64_t w1) {
    size_t c = std::upper_bound(tile_base.begin(), tile_base.end(), w0) - tile_base.begin() - 1;
    for (int64_t w = w0; w < w1; ++w) {
      while (w >= tile_base[c + 1]) ++c;
      const Job<E>& j = jobs[c];
      const int64_t local = w - tile_base[c], h = local / tiles_of[c], kp = j.key_start + (local % tiles_of[c]) * KT;
      transpose_tile<DC, E>(j, h, kp, kt.data() + w * D * KT);
    }
  });
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {  // thread t: the items whose cost ends in its share
      const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
      for (int64_t it = 0; it < n_items; ++it) {
        if (cost_end[it] <= lo || cost_end[it] > hi) continue;
        const Item& x = items[it];
        const float* ktiles = kt.data() + (tile_base[x.job] + x.h * tiles_of[x.job]) * D * KT;
        item<DC, E>(jobs[x.job], ktiles, x.h, x.i0, x.i1);
      }
    }
  });
}

#else
constexpr int64_t SUB = 16;
#endif

}  // namespace

void check_paged_chunks(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                        const std::vector<int64_t>& ctx, const std::vector<int64_t>& q_start,
                        const std::vector<int64_t>& key_from) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [N, Hq, D] fp32, heads and dims contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf) &&
                  kv_cache.is_contiguous(),
              "kv_cache: [2, NB, BS, Hkv, D] fp32 or fp16, contiguous");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), B = static_cast<int64_t>(ctx.size());
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hkv > 0 && Hq % Hkv == 0, "kv_cache heads/dims do not fit q");
  TORCH_CHECK(D == 64 || D == 96 || D == 128 || D == 256, "head dim must be 64, 96, 128 or 256, got ", D);
  TORCH_CHECK(B > 0 && static_cast<int64_t>(q_start.size()) == B + 1 && q_start[0] == 0 && q_start[B] == N,
              "need one ctx per chunk and q_start [0, .., N] (chunks + 1 entries)");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong && tables.stride(1) == 1,
              "tables: int64 [chunks, W], rows contiguous");
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t c = 0; c < B; ++c) {
    const int64_t T = q_start[c + 1] - q_start[c];
    TORCH_CHECK(T > 0 && ctx[c] >= T, "chunk ", c, ": need 0 < T <= ctx");
    TORCH_CHECK(tables.size(1) * BS >= ctx[c], "chunk ", c, ": its table row covers fewer than ctx = ", ctx[c], " keys");
    for (int64_t b = std::max<int64_t>(key_from[c], 0) / BS; b < (ctx[c] + BS - 1) / BS; ++b) {
      const int64_t e = tp[c * tables.stride(0) + b];
      TORCH_CHECK(e >= 0 && e < NB, "block table entry ", e, " outside the cache's ", NB, " blocks");
    }
  }
}

std::tuple<at::Tensor, at::Tensor> prefill_attention_many(const at::Tensor& q, const at::Tensor& kv_cache,
                                                          const at::Tensor& tables, const std::vector<int64_t>& ctx,
                                                          const std::vector<int64_t>& q_start,
                                                          const std::vector<int64_t>& key_start, double scale) {
  const int64_t B = static_cast<int64_t>(ctx.size());
  TORCH_CHECK(static_cast<int64_t>(key_start.size()) == B, "need one key_start per chunk");
  check_paged_chunks(q, kv_cache, tables, ctx, q_start, key_start);
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(BS % SUB == 0, "block size must be a multiple of ", SUB);
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t c = 0; c < B; ++c) {
    const int64_t T = q_start[c + 1] - q_start[c];
    TORCH_CHECK(key_start[c] >= 0 && key_start[c] % SUB == 0 && key_start[c] <= ctx[c] - T,
                "chunk ", c, ": need 0 < T <= ctx and key_start a multiple of 16 at most ctx - T");
  }
  auto out = at::empty({N, Hq, D}, q.options());
  auto lse = at::empty({N, Hq}, q.options());
#if defined(EDGELLM_V16)
  auto launch = [&](const auto* kc) {
    using E = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    std::vector<Job<E>> jobs;
    for (int64_t c = 0; c < B; ++c) {
      const int64_t s0 = q_start[c];
      jobs.push_back(Job<E>{q.data_ptr<float>() + s0 * q.stride(0), q.stride(0), kc, kc + NB * BS * Hkv * D,
                            tp + c * tables.stride(0), BS, Hkv, Hq, D, Hq / Hkv, q_start[c + 1] - s0, ctx[c],
                            key_start[c], static_cast<float>(scale), out.data_ptr<float>() + s0 * Hq * D,
                            lse.data_ptr<float>() + s0 * Hq});
    }
    pybind11::gil_scoped_release no_gil;
    switch (D) {
      case 64: run<4>(jobs); break;
      case 96: run<6>(jobs); break;
      case 128: run<8>(jobs); break;
      default: run<16>(jobs); break;
    }
  };
  if (kv_cache.scalar_type() == at::kHalf) launch(reinterpret_cast<const c10::Half*>(kv_cache.data_ptr()));
  else launch(kv_cache.data_ptr<float>());
#else
  TORCH_CHECK(false, "prefill_attention needs a build with AVX2 or AVX-512 (n16_variant() != 'scalar')");
#endif
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                                     const at::Tensor& table, int64_t ctx, int64_t key_start,
                                                     double scale) {
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "table: int64 [>= ceil(ctx / BS)]");
  TORCH_CHECK(q.dim() == 3, "q: [T, Hq, D] fp32, heads and dims contiguous");
  return prefill_attention_many(q, kv_cache, table.unsqueeze(0), {ctx}, {0, q.size(0)}, {key_start}, scale);
}

}  // namespace edgellm::cpu
