// Decode attention over the paged KV cache: one query token per sequence, K and V read straight
// from the pages (see edgellm/kernels/cpu_native.py for the whole picture).
#include "attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <pybind11/pybind11.h>
#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

namespace edgellm::cpu {

#if defined(EDGELLM_V16)
// out[t] = mul * (q . row_t) for the cnt <= 16 rows of a tile (D % 16 == 0).
template <typename T>
static inline void score_tile(const float* q, const T* const* rows, int64_t off, int cnt, int64_t D, float mul,
                              float* out) {
  V16 part[16];
  for (int t = 0; t < 16; ++t) {
    if (t < cnt) {
      const T* r = rows[t] + off;
      V16 a = v16_mul(v16_load(q), load16(r));
      for (int64_t d = 16; d < D; d += 16) a = v16_fmadd(v16_load(q + d), load16(r + d), a);
      part[t] = a;
    } else {
      part[t] = v16_zero();
    }
  }
  v16_store_first(out, v16_mul(hsum16(part), v16_set1(mul)), cnt);
}

// out[g * D + c * 16 ..] (+)= sum_t p[g * pstride + t] * row_t[c * 16 ..] over the n tokens of a
// tile, for NG heads and NC 16-wide chunks of the row, the NG x NC accumulators in registers.
template <typename T, int NG, int NC>
static void pv_block(const float* p, int64_t pstride, const T* const* rows, int64_t off, int64_t n, float* out,
                     int64_t D, bool first) {
  V16 acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = first ? v16_zero() : v16_load(out + g * D + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const T* r = rows[t] + off;
    V16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(r + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const V16 pb = v16_set1(p[g * pstride + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = v16_fmadd(pb, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) v16_store(out + g * D + 16 * c, acc[g][c]);
}

template <typename T, int NG>
static void pv_heads(const float* p, int64_t pstride, const T* const* rows, int64_t off, int64_t n, float* out,
                     int64_t D, bool first) {
  // up to V16_PV_CHUNKS 16-lane chunks of the row per pass: as many accumulators as the ISA's
  // registers hold (vec.h)
  for (int64_t c0 = 0; c0 < D; c0 += 16 * V16_PV_CHUNKS) {
    switch (std::min<int64_t>(V16_PV_CHUNKS, (D - c0) / 16)) {
      case 4: pv_block<T, NG, 4>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      case 3: pv_block<T, NG, 3>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      case 2: pv_block<T, NG, 2>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
      default: pv_block<T, NG, 1>(p, pstride, rows, off + c0, n, out + c0, D, first); break;
    }
  }
}

// Prefetch the rows of tokens [t0, t1) (`bytes` from each row's start) into L1.
template <typename T>
static inline void prefetch_rows(const T* const* rows, int64_t t0, int64_t t1, int64_t off, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    const char* f = reinterpret_cast<const char*>(rows[t] + off);
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(f + l, _MM_HINT_T0);
  }
}

// One work item of attend() on AVX-512 or AVX2 (D % 16 == 0): M sequences ("members") whose first
// `shared` context tokens are the same cached pages (M = 1, shared = 0: one sequence). Member m has
// query heads qh[m] [GH, D] (GH = hpi * G, kv head h0 + g / G), n[m] context tokens with rows[m][t]
// pointing at head h0's K row of token t (V at + voff), output out[m] and scores[m] [GH, n[m]].
// Both passes go 16 tokens (a page, at the default block size) at a time, every head of the item
// over one tile while it is in L1, the next tile prefetched (pages sit anywhere in the cache and
// the hardware prefetcher stops at each one); a shared tile serves every member before the next
// is read, so a cached system prompt is read from memory once per item, not once per sequence.
// Each member's sums run in the same order either way. The softmax runs per kChunk chunk of a
// member's tokens (attention.h): with more than one, part[m] holds the chunks' outputs
// [chunk][GH][D] and lse[m] their log-sum-exps [chunk][GH], merged into out[m] at the end; with one
// (part[m] nullptr) the output goes to out[m] and, where lse[m] is given, its log-sum-exps to
// lse[m][0, GH) (a chunk item of a longer context, merged by the caller).
template <typename T>
static void attend_members(const float* const* qh, float* const* out, const T* const* const* rows, const int64_t* n,
                           int64_t M, int64_t shared, int64_t voff, int64_t hpi, int64_t G, int64_t D, float ksc,
                           float v_mul, float* const* scores, float* const* part, float* const* lse) {
  const int64_t GH = hpi * G;
  const int64_t bytes = hpi * D * static_cast<int64_t>(sizeof(T));  // one token's K (or V) rows
  shared -= shared % 16;  // whole tiles
  auto score_tiles = [&](int64_t m, int64_t t0) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n[m] - t0));
    for (int64_t hq = 0; hq < GH; ++hq)
      score_tile(qh[m] + hq * D, rows[m] + t0, (hq / G) * D, cnt, D, ksc, scores[m] + hq * n[m] + t0);
  };
  auto pv_tiles = [&](int64_t m, int64_t t0) {
    const int64_t cnt = std::min<int64_t>(16, n[m] - t0);
    float* dst = part[m] != nullptr ? part[m] + (t0 / kChunk) * GH * D : out[m];  // this tile's chunk
    const bool first = t0 % kChunk == 0;
    for (int64_t hh = 0; hh < hpi; ++hh) {
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const float* p = scores[m] + (hh * G + g0) * n[m] + t0;
        float* o = dst + (hh * G + g0) * D;
        const int64_t off = voff + hh * D;
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: pv_heads<T, 4>(p, n[m], rows[m] + t0, off, cnt, o, D, first); break;
          case 3: pv_heads<T, 3>(p, n[m], rows[m] + t0, off, cnt, o, D, first); break;
          case 2: pv_heads<T, 2>(p, n[m], rows[m] + t0, off, cnt, o, D, first); break;
          default: pv_heads<T, 1>(p, n[m], rows[m] + t0, off, cnt, o, D, first); break;
        }
      }
    }
  };
  for (int64_t t0 = 0; t0 < shared; t0 += 16) {
    prefetch_rows(rows[0], t0 + 16, std::min(shared, t0 + 32), 0, bytes);
    for (int64_t m = 0; m < M; ++m) score_tiles(m, t0);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t t0 = shared; t0 < n[m]; t0 += 16) {
      prefetch_rows(rows[m], t0 + 16, std::min(n[m], t0 + 32), 0, bytes);
      score_tiles(m, t0);
    }
    const int64_t nck = (n[m] + kChunk - 1) / kChunk;
    for (int64_t g = 0; g < GH; ++g) {
      for (int64_t c = 0; c < nck; ++c) {
        float* sg = scores[m] + g * n[m] + c * kChunk;
        const int64_t len = std::min(kChunk, n[m] - c * kChunk);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
        const float sum = exp_shifted_sum(sg, len, mx);
        const float inv = v_mul / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
        if (lse[m] != nullptr) lse[m][c * GH + g] = mx + std::log(sum);
      }
    }
  }
  prefetch_rows(rows[0], 0, std::min<int64_t>(n[0], 16), voff, bytes);
  for (int64_t t0 = 0; t0 < shared; t0 += 16) {
    prefetch_rows(rows[0], t0 + 16, std::min(shared, t0 + 32), voff, bytes);
    for (int64_t m = 0; m < M; ++m) pv_tiles(m, t0);
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t t0 = shared; t0 < n[m]; t0 += 16) {
      prefetch_rows(rows[m], t0 + 16, std::min(n[m], t0 + 32), voff, bytes);
      pv_tiles(m, t0);
    }
    if (part[m] != nullptr) {
      const int64_t nck = (n[m] + kChunk - 1) / kChunk;
      for (int64_t g = 0; g < GH; ++g) merge_chunks(part[m] + g * D, GH * D, lse[m] + g, GH, nck, D, out[m] + g * D);
    }
  }
}

#endif

// Decode attention for B sequences (declared, with its parameters, in attention.h).
template <typename T>
void attend(const float* q, int64_t q_stride, float* out, int64_t out_stride, const T* kc, const T* vc, int64_t BS,
            int64_t Hkv, int64_t D, int64_t G, const int64_t* bt, int64_t MB, const int64_t* sl, int64_t B, float sc,
            int64_t window, float k_mul, float v_mul, const std::vector<AttnItem>* plan) {
  // Work items: one sequence with all its kv heads when there are enough sequences for the
  // threads (its K/V tokens are then read as whole contiguous rows), else one (sequence, kv head).
  const int64_t hpi = B >= 2 * at::get_num_threads() ? Hkv : 1;  // kv heads per item
  const int64_t GH = G * hpi;  // query heads per item
#if defined(EDGELLM_V16)
  if (D % 16 == 0) {
    std::vector<AttnItem> own;
    if (plan == nullptr) own = attn_items(bt, MB, sl, B, BS, Hkv, window);
    const std::vector<AttnItem>& items = plan != nullptr ? *plan : own;
    const int64_t Hq = Hkv * G;
    auto window_of = [&](int64_t b) {  // (first token, tokens) of sequence b's attended context
      const int64_t lo = window > 0 ? std::max<int64_t>(0, sl[b] - window) : 0;
      return std::pair<int64_t, int64_t>(lo, sl[b] - lo);
    };
    // the chunk items' outputs [chunk][Hq][D] and log-sum-exps [chunk][Hq], per split sequence
    std::vector<int64_t> split_at(B, -1);
    int64_t split_floats = 0;
    for (const AttnItem& it : items) {
      const int64_t b = it.members[0];
      if (it.chunk < 0 || split_at[b] >= 0) continue;
      split_at[b] = split_floats;
      split_floats += (window_of(b).second + kChunk - 1) / kChunk * Hq * (D + 1);
    }
    std::vector<float> split(split_floats);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<std::vector<float>> scores, parts, lses;
      std::vector<std::vector<const T*>> rows;
      std::vector<const float*> qh;
      std::vector<float*> oh, sp, pp, lp;
      std::vector<const T* const*> rp;
      std::vector<int64_t> n;
      const int64_t row = Hkv * D;
      for (int64_t i = begin; i < end; ++i) {
        const AttnItem& it = items[i];
        const int64_t M = static_cast<int64_t>(it.members.size()), GH = it.hpi * G;
        scores.resize(M), parts.resize(M), lses.resize(M), rows.resize(M);
        qh.resize(M), oh.resize(M), sp.resize(M), pp.resize(M), lp.resize(M), rp.resize(M), n.resize(M);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t b = it.members[m];
          const auto [lo0, n0] = window_of(b);
          const int64_t lo = it.chunk < 0 ? lo0 : lo0 + it.chunk * kChunk;  // this item's tokens
          const int64_t hi = it.chunk < 0 ? lo0 + n0 : std::min(lo0 + n0, lo + kChunk);
          n[m] = hi - lo;
          scores[m].resize(GH * n[m]);
          rows[m].resize(n[m]);
          for (int64_t t = lo; t < hi; ++t)
            rows[m][t - lo] = kc + (bt[b * MB + t / BS] * BS + t % BS) * row + it.h0 * D;
          qh[m] = q + b * q_stride + it.h0 * G * D;
          sp[m] = scores[m].data();
          rp[m] = rows[m].data();
          const int64_t nck = (n[m] + kChunk - 1) / kChunk;
          if (it.chunk >= 0) {  // one chunk of a split sequence: into its slots, merged below
            float* chunks = split.data() + split_at[b];
            const int64_t all = (n0 + kChunk - 1) / kChunk;
            oh[m] = chunks + it.chunk * Hq * D + it.h0 * G * D;
            lp[m] = chunks + all * Hq * D + it.chunk * Hq + it.h0 * G;
            pp[m] = nullptr;
          } else {
            oh[m] = out + b * out_stride + it.h0 * G * D;
            parts[m].resize(nck > 1 ? nck * GH * D : 0);
            lses[m].resize(nck > 1 ? nck * GH : 0);
            pp[m] = nck > 1 ? parts[m].data() : nullptr;
            lp[m] = nck > 1 ? lses[m].data() : nullptr;
          }
        }
        attend_members<T>(qh.data(), oh.data(), rp.data(), n.data(), M, it.shared, vc - kc, it.hpi, G, D,
                          sc * k_mul, v_mul, sp.data(), pp.data(), lp.data());
      }
    });
    for (int64_t b = 0; b < B; ++b) {  // the split sequences' chunks, merged as attend_members merges
      if (split_at[b] < 0) continue;
      const int64_t all = (window_of(b).second + kChunk - 1) / kChunk;
      const float* chunks = split.data() + split_at[b];
      for (int64_t h = 0; h < Hq; ++h)
        merge_chunks(chunks + h * D, Hq * D, chunks + all * Hq * D + h, Hq, all, D, out + b * out_stride + h * D);
    }
    return;
  }
#endif
  at::parallel_for(0, B * (Hkv / hpi), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(GH * D);
    std::vector<float> buf(D);
    std::vector<float> dk(G);
    const float ksc = sc * k_mul;
    const int64_t row = Hkv * D;  // one token's K (or V) in a page
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (Hkv / hpi), h0 = (i % (Hkv / hpi)) * hpi;
      const int64_t len = sl[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - lo;
      scores.resize(GH * n);
      const float* qb = q + b * q_stride + h0 * G * D;
      // page by page: no division per position
      for (int64_t j = lo / BS; j * BS < len; ++j) {
        const T* page = kc + (bt[b * MB + j] * BS * Hkv + h0) * D;
        const int64_t t1 = std::min(len, (j + 1) * BS);
        for (int64_t t = std::max(lo, j * BS); t < t1; ++t) {
          const T* tok = page + (t - j * BS) * row;
          for (int64_t hh = 0; hh < hpi; ++hh) {
            dots(qb + hh * G * D, load_row(tok + hh * D, buf.data(), D), D, G, dk.data());
            for (int64_t g = 0; g < G; ++g) scores[(hh * G + g) * n + (t - lo)] = dk[g] * ksc;
          }
        }
      }
      for (int64_t g = 0; g < GH; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
        const float sum = exp_shifted_sum(sg, n, mx);
        const float inv = v_mul / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = lo / BS; j * BS < len; ++j) {
        const T* page = vc + (bt[b * MB + j] * BS * Hkv + h0) * D;
        const int64_t t1 = std::min(len, (j + 1) * BS);
        for (int64_t t = std::max(lo, j * BS); t < t1; ++t) {
          const T* tok = page + (t - j * BS) * row;
          for (int64_t hh = 0; hh < hpi; ++hh)
            axpys(acc.data() + hh * G * D, scores.data() + hh * G * n + (t - lo), n,
                  load_row(tok + hh * D, buf.data(), D), D, G);
        }
      }
      std::copy(acc.begin(), acc.end(), out + b * out_stride + h0 * G * D);
    }
  });
}

template void attend<float>(const float*, int64_t, float*, int64_t, const float*, const float*, int64_t, int64_t,
                            int64_t, int64_t, const int64_t*, int64_t, const int64_t*, int64_t, float, int64_t,
                            float, float, const std::vector<AttnItem>*);
template void attend<c10::Half>(const float*, int64_t, float*, int64_t, const c10::Half*, const c10::Half*, int64_t,
                                 int64_t, int64_t, int64_t, const int64_t*, int64_t, const int64_t*, int64_t, float,
                                 int64_t, float, float, const std::vector<AttnItem>*);
template void attend<uint8_t>(const float*, int64_t, float*, int64_t, const uint8_t*, const uint8_t*, int64_t,
                              int64_t, int64_t, int64_t, const int64_t*, int64_t, const int64_t*, int64_t, float,
                              int64_t, float, float, const std::vector<AttnItem>*);

void check_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t B, int64_t NB,
                  int64_t BS) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables: [B, MB] int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  TORCH_CHECK(block_tables.size(0) >= B && seq_lens.size(0) >= B, "one row per sequence");
  const int64_t MB = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= MB * BS, "sequence length out of its block table");
    for (int64_t j = 0; j < (sl[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < NB, "block id out of the cache");
  }
}

void check_cache(const at::Tensor& kv_cache, int64_t D, bool fp8_ok) {
  const auto t = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() &&
              (t == at::kFloat || t == at::kHalf || (fp8_ok && t == at::ScalarType::Float8_e4m3fn)),
              "kv_cache: [2, NB, BS, Hkv, D] contiguous, fp32 or fp16 (or fp8 e4m3fn in decode_layers)");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == D, "kv_cache head_dim");
}

// q [B, Hq, D] fp32; kv_cache [2, NB, BS, Hkv, D] fp32 or fp16; block_tables [B, MB] int64;
// seq_lens [B] int64 (context length, this step's token included); window <= 0: none.
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, Hq, D] fp32");
  pybind11::gil_scoped_release no_gil;  // pure tensor work: let the server's event loop run meanwhile
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  check_cache(kv_cache, D);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  check_tables(block_tables, seq_lens, B, NB, BS);
  auto out = at::empty_like(q);
  const int64_t half = NB * BS * Hkv * D;  // elements of K before V's
  auto run = [&](const auto* kc) {
    attend(q.data_ptr<float>(), Hq * D, out.data_ptr<float>(), Hq * D, kc, kc + half, BS, Hkv, D, Hq / Hkv,
           block_tables.data_ptr<int64_t>(), block_tables.size(1), seq_lens.data_ptr<int64_t>(), B,
           static_cast<float>(scale), window);
  };
  if (kv_cache.scalar_type() == at::kHalf) run(reinterpret_cast<const c10::Half*>(kv_cache.data_ptr()));
  else run(kv_cache.data_ptr<float>());
  return out;
}

}  // namespace edgellm::cpu
