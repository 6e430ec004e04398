// Shared-prefix prefill attention with bf16 products (the contract: cascade_attention.h).
//
// Keys and values are repacked once per call into the layouts vdpbf16ps takes, the shared prefix's
// once per kv head and each chunk's own keys once per chunk and kv head:
//   kp[dp][n] = the 32 bits of (k[n][2 dp], k[n][2 dp + 1]): one vdpbf16ps takes two dims of 16
//               keys (the zmm lanes) against the same two dims of a query broadcast;
//   vp[n2][d] = (v[2 n2][d], v[2 n2 + 1][d]): one vdpbf16ps takes two keys of 16 dims (the lanes)
//               against the same two keys' probabilities broadcast.
// A task is one chunk, one kv head and 16 query positions (its G query heads' rows, 16 at a time):
// the rows' scores over the prefix and over the chunk's own keys go to one fp32 buffer (register
// micro-tiles of 4 rows x 64 keys), each row's max, exp and sum are taken over the keys it sees
// (the rest weigh 0), its probabilities rounded to bf16 pairs, then the values accumulate in
// registers (4 rows x 64 dims) and the row is divided by its sum. No scores, probabilities or
// partial outputs leave the task, and no log-sum-exp merge is needed: prefix and own keys are one
// softmax. Without AVX512-BF16: the same products and sums in scalar code.
#include "cascade_attention.h"

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace edgellm::cpu {
namespace {

constexpr int64_t KT = 16;    // keys per score vector
constexpr int64_t ROWS = 16;  // query rows per score buffer
constexpr int64_t BQ = 16;    // query positions per task

inline float bf16_lo(uint32_t p) {
  const uint32_t b = p << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float bf16_hi(uint32_t p) { return bf16_lo(p >> 16); }

// dst[i] = bf16(src[i]), rounded to nearest even (vcvtneps2bf16 where built in)
void to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

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

// Keys [k0, k0 + n) of kv head h through one table row into kp [D / 2][NP] and vp [NP / 2][D]
// (NP >= n, even; keys past n are 0).
template <typename E>
void repack(const E* kc, const E* vc, const int64_t* table, int64_t BS, int64_t Hkv, int64_t D, int64_t h, int64_t k0,
            int64_t n, int64_t NP, uint32_t* kp, uint32_t* vp) {
  const int64_t D2 = D / 2;
  std::fill(kp, kp + D2 * NP, 0u);
  std::fill(vp, vp + NP / 2 * D, 0u);
  alignas(64) float buf[256];
  alignas(64) c10::BFloat16 kb[256], vb[256];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = k0 + j, slot = (table[pos / BS] * BS + pos % BS) * Hkv + h;
    to_bf16(load_row(kc + slot * D, buf, D), kb, D);
    uint32_t pairs[128];
    std::memcpy(pairs, kb, D * 2);  // (k[2 dp], k[2 dp + 1]) as one 32-bit word
    for (int64_t dp = 0; dp < D2; ++dp) kp[dp * NP + j] = pairs[dp];
    to_bf16(load_row(vc + slot * D, buf, D), vb, D);
    uint32_t* vrow = vp + j / 2 * D;
    const int shift = j % 2 ? 16 : 0;
    for (int64_t d = 0; d < D; ++d) vrow[d] |= static_cast<uint32_t>(vb[d].x) << shift;
  }
}

#if defined(__AVX512BF16__)
// scale * scores of rows [0, R) of q (D2 pairs each) against key vectors [j0, j0 + T) of kp, into
// s (rows ldS apart).
template <int R, int T>
void score_tile(const uint32_t* q, int64_t D2, const uint32_t* kp, int64_t NP, int64_t j0, float* s, int64_t ldS,
                float scale) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D2; ++dp) {
    __m512bh kv[T];
    for (int t = 0; t < T; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(kp + dp * NP + (j0 + t) * KT);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D2 + dp]));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qv, kv[t]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(s + r * ldS + (j0 + t) * KT, _mm512_mul_ps(acc[r][t], sv));
}

template <int R>
void score_rows(const uint32_t* q, int64_t D2, const uint32_t* kp, int64_t NP, float* s, int64_t ldS, float scale) {
  int64_t j = 0;
  for (; j + 4 <= NP / KT; j += 4) score_tile<R, 4>(q, D2, kp, NP, j, s, ldS, scale);
  for (; j < NP / KT; ++j) score_tile<R, 1>(q, D2, kp, NP, j, s, ldS, scale);
}

// acc rows [0, R) (D floats each) += sum over key pairs n2 < n2s of p[r][n2] . vp[n2]
template <int DC, int R>
void pv_rows(const uint32_t* p, int64_t ldP, int64_t n2s, const uint32_t* vp, float* acc) {
  constexpr int64_t D = DC * 16;
  __m512 a[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
  for (int64_t n2 = 0; n2 < n2s; ++n2) {
    __m512bh vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + n2 * D + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * ldP + n2]));
      for (int c = 0; c < DC; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pb, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}
#endif

// scale * scores of rows [0, rows) against the NP keys of kp into s (rows ldS apart)
void scores(const uint32_t* q, int64_t rows, int64_t D2, const uint32_t* kp, int64_t NP, float* s, int64_t ldS,
            float scale) {
#if defined(__AVX512BF16__)
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) score_rows<4>(q + r * D2, D2, kp, NP, s + r * ldS, ldS, scale);
  for (; r < rows; ++r) score_rows<1>(q + r * D2, D2, kp, NP, s + r * ldS, ldS, scale);
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < NP; ++n) {
      float acc = 0.f;
      for (int64_t dp = 0; dp < D2; ++dp) {
        const uint32_t a = q[r * D2 + dp], b = kp[dp * NP + n];
        acc += bf16_lo(a) * bf16_lo(b) + bf16_hi(a) * bf16_hi(b);
      }
      s[r * ldS + n] = acc * scale;
    }
  }
#endif
}

// acc [rows, D] += p [rows, n2s pairs] (rows ldP apart) x vp [n2s][D]
template <int DC>
void values(const uint32_t* p, int64_t ldP, int64_t rows, int64_t n2s, const uint32_t* vp, float* acc) {
  constexpr int64_t D = DC * 16;
#if defined(__AVX512BF16__)
  constexpr int R = DC <= 4 ? 4 : DC <= 8 ? 2 : 1;  // R x DC accumulators beside DC value vectors
  int64_t r = 0;
  for (; r + R <= rows; r += R) pv_rows<DC, R>(p + r * ldP, ldP, n2s, vp, acc + r * D);
  for (; r < rows; ++r) pv_rows<DC, 1>(p + r * ldP, ldP, n2s, vp, acc + r * D);
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n2 = 0; n2 < n2s; ++n2) {
      const uint32_t pp = p[r * ldP + n2];
      for (int64_t d = 0; d < D; ++d) {
        const uint32_t vv = vp[n2 * D + d];
        acc[r * D + d] += bf16_lo(pp) * bf16_lo(vv) + bf16_hi(pp) * bf16_hi(vv);
      }
    }
  }
#endif
}

struct Plan {
  const float* q;
  int64_t q_tok, Hq, Hkv, G, D, P;
  float scale;
  const int64_t* q_start;
  const int64_t* ctx;
  const uint32_t *kp_pre, *vp_pre;       // per kv head: [D / 2][P], [P / 2][D]
  const uint32_t* own;                   // per chunk, per kv head: kp [D / 2][Lp], then vp [Lp / 2][D]
  const int64_t *own_at, *own_len, *own_pad;  // per chunk: offset in own, L = ctx - P, Lp (L rounded up to 16)
  float* out;
};

// rows of chunk c, kv head h, query positions [i0, i1)
template <int DC>
void task(const Plan& w, int64_t c, int64_t h, int64_t i0, int64_t i1, std::vector<float>& s,
          std::vector<uint32_t>& qb, std::vector<uint32_t>& pb, std::vector<float>& acc) {
  constexpr int64_t D = DC * 16, D2 = D / 2;
  const int64_t P = w.P, L = w.own_len[c], Lp = w.own_pad[c], S = P + Lp, nq = i1 - i0;
  const int64_t first = w.ctx[c] - (w.q_start[c + 1] - w.q_start[c]);  // position of the chunk's row 0
  const uint32_t* kp_own = w.own + w.own_at[c] + h * (D2 * Lp + Lp / 2 * D);
  const uint32_t* vp_own = kp_own + D2 * Lp;
  s.resize(ROWS * S);
  pb.resize(ROWS * S / 2);
  float l[ROWS];
  for (int64_t r0 = 0; r0 < w.G * nq; r0 += ROWS) {
    const int64_t rows = std::min(ROWS, w.G * nq - r0);
    for (int64_t rr = 0; rr < rows; ++rr) {  // row r: head g = r / nq of the group, position i0 + r % nq
      const int64_t r = r0 + rr, g = r / nq, i = i0 + r % nq;
      // bf16 dims (2 dp, 2 dp + 1) side by side: the pair of dims dp as one 32-bit word
      to_bf16(w.q + (w.q_start[c] + i) * w.q_tok + (h * w.G + g) * D, reinterpret_cast<c10::BFloat16*>(qb.data() + rr * D2), D);
    }
    scores(qb.data(), rows, D2, w.kp_pre + h * D2 * P, P, s.data(), S, w.scale);
    scores(qb.data(), rows, D2, kp_own, Lp, s.data() + P, S, w.scale);
    int64_t seen_most = 0;
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t pos = first + i0 + (r0 + rr) % nq;
      const int64_t seen = P + std::min(L, pos - P + 1);  // keys 0 .. pos
      float* row = s.data() + rr * S;
      l[rr] = exp_shifted_sum(row, seen, row_max(row, seen));
      std::fill(row + seen, row + S, 0.f);
      to_bf16(row, reinterpret_cast<c10::BFloat16*>(pb.data() + rr * S / 2), S);
      seen_most = std::max(seen_most, seen);
    }
    std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
    values<DC>(pb.data(), S / 2, rows, P / 2, w.vp_pre + h * P / 2 * D, acc.data());
    values<DC>(pb.data() + P / 2, S / 2, rows, (seen_most - P + 1) / 2, vp_own, acc.data());
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t r = r0 + rr, g = r / nq, i = i0 + r % nq;
      float* o = w.out + ((w.q_start[c] + i) * w.Hq + h * w.G + g) * D;
      const float inv = 1.f / l[rr];
      for (int64_t d = 0; d < D; ++d) o[d] = acc[rr * D + d] * inv;
    }
  }
}

template <int DC>
void run_tasks(const Plan& w, int64_t C) {
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
    std::vector<uint32_t> qb(ROWS * DC * 8), pb;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t T = w.q_start[tc[t] + 1] - w.q_start[tc[t]];
      task<DC>(w, tc[t], th[t], ti[t], std::min(T, ti[t] + BQ), s, qb, pb, acc);
    }
  });
}

}  // namespace

at::Tensor cascade_attention_bf16(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                                  const std::vector<int64_t>& ctx, const std::vector<int64_t>& q_start,
                                  int64_t prefix, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [N, Hq, D] fp32, heads and dims contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf) &&
                  kv_cache.is_contiguous(),
              "kv_cache: [2, NB, BS, Hkv, D] fp32 or fp16, contiguous");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), C = static_cast<int64_t>(ctx.size());
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3), P = prefix;
  TORCH_CHECK(kv_cache.size(4) == D && Hkv > 0 && Hq % Hkv == 0, "kv_cache heads/dims do not fit q");
  TORCH_CHECK(D == 64 || D == 96 || D == 128 || D == 256, "head dim must be 64, 96, 128 or 256, got ", D);
  TORCH_CHECK(P > 0 && P % 16 == 0 && P % BS == 0, "prefix must be a positive multiple of 16 and of the block size");
  TORCH_CHECK(C > 0 && static_cast<int64_t>(q_start.size()) == C + 1 && q_start[0] == 0 && q_start[C] == N,
              "need one ctx per chunk and q_start [0, .., N] (chunks + 1 entries)");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == C && tables.scalar_type() == at::kLong && tables.stride(1) == 1,
              "tables: int64 [chunks, W], rows contiguous");
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<int64_t> own_at(C), own_len(C), own_pad(C);
  int64_t own_total = 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t T = q_start[c + 1] - q_start[c];
    TORCH_CHECK(T > 0 && ctx[c] - T >= P, "chunk ", c, ": need rows, and the prefix wholly before its first query");
    TORCH_CHECK(tables.size(1) * BS >= ctx[c], "chunk ", c, ": its table row covers fewer than ctx = ", ctx[c], " keys");
    for (int64_t b = c == 0 ? 0 : P / BS; b < (ctx[c] + BS - 1) / BS; ++b) {
      const int64_t e = tp[c * tables.stride(0) + b];
      TORCH_CHECK(e >= 0 && e < NB, "block table entry ", e, " outside the cache's ", NB, " blocks");
    }
    own_len[c] = ctx[c] - P;
    own_pad[c] = (own_len[c] + KT - 1) / KT * KT;
    own_at[c] = own_total;
    own_total += Hkv * (D / 2 * own_pad[c] + own_pad[c] / 2 * D);
  }
  auto out = at::empty({N, Hq, D}, q.options());
  std::vector<uint32_t> pre(Hkv * (D / 2 * P + P / 2 * D)), own(own_total);
  pybind11::gil_scoped_release no_gil;
  auto repack_all = [&](const auto* kc) {
    const auto* vc = kc + NB * BS * Hkv * D;
    at::parallel_for(0, Hkv * (C + 1), 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t c = u / Hkv - 1, h = u % Hkv;  // c == -1: the shared prefix
        if (c < 0) {
          uint32_t* kp = pre.data() + h * (D / 2 * P);
          repack(kc, vc, tp, BS, Hkv, D, h, 0, P, P, kp, pre.data() + Hkv * (D / 2 * P) + h * (P / 2 * D));
        } else {
          uint32_t* kp = own.data() + own_at[c] + h * (D / 2 * own_pad[c] + own_pad[c] / 2 * D);
          repack(kc, vc, tp + c * tables.stride(0), BS, Hkv, D, h, P, own_len[c], own_pad[c], kp,
                 kp + D / 2 * own_pad[c]);
        }
      }
    });
  };
  if (kv_cache.scalar_type() == at::kHalf) repack_all(reinterpret_cast<const c10::Half*>(kv_cache.data_ptr()));
  else repack_all(kv_cache.data_ptr<float>());
  const Plan w{q.data_ptr<float>(), q.stride(0), Hq, Hkv, Hq / Hkv, D, P, static_cast<float>(scale), q_start.data(),
               ctx.data(), pre.data(), pre.data() + Hkv * (D / 2 * P), own.data(), own_at.data(), own_len.data(),
               own_pad.data(), out.data_ptr<float>()};
  switch (D / 16) {
    case 4: run_tasks<4>(w, C); break;
    case 6: run_tasks<6>(w, C); break;
    case 8: run_tasks<8>(w, C); break;
    default: run_tasks<16>(w, C); break;
  }
  return out;
}

}  // namespace edgellm::cpu
