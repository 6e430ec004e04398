// The n16 integer-dot matmul on AMX tiles (the contract: qgemm_n16.h), for steps of many rows.
//
// Per tile of 16 outputs and 16 activation rows, per 32-column block: tdpbsud (signed
// activations x unsigned codes) of the 16 x 32 activation codes (tile A, read in place, row
// stride K) and the block's 8 x 64 layout bytes (tile B: the n16 layout is AMX's B operand as
// it is; int4 and 5/6-bit codes are unpacked into it once per tile strip) gives the 16 x 16 exact
// int32 block dots (int8 and narrow codes: + n16_zero(bits) x the activation block's code sum,
// subtracted in integers); they are stored,
// converted and scaled in AVX-512 (scale per output lane, step per row) into 16 fp32
// accumulators. Two blocks go at a time on two tile sets, so one block's dot runs while the
// other's sums are scaled. Groups of 16 (int8, narrow codes) take each half block on its own (tiles 3, 4).
// Linux grants a process the tile state on request (arch_prctl), asked once; each thread loads
// the tile configuration at the start of its share of a call and releases it at the end.
#include "qgemm_n16.h"

#include <c10/util/Exception.h>

#include <type_traits>
#include <vector>
#if defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qgemm_n16_zmm_codes.h"
#include "qgemm_n16_zmm_scales.h"
#define EDGELLM_AMX 1
#endif

namespace edgellm::cpu {

#if defined(EDGELLM_AMX)
namespace {

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 0, 6: A (16 rows x 32 codes); 1, 7: B (8 x 64 bytes); 2, 5: C (16 x 16 int32);
// 3: A of a half block (16 x 16 codes); 4: B of a half block (4 x 64 bytes)
TileConfig make_config() {
  TileConfig c;
  const int shape[8][2] = {{16, 32}, {8, 64}, {16, 64}, {16, 16}, {4, 64}, {16, 64}, {16, 32}, {8, 64}};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(shape[t][0]);
    c.colsb[t] = static_cast<uint16_t>(shape[t][1]);
  }
  return c;
}

// tilestored of a 16 x 16 int32 tile into c, declared as writing exactly c (GCC's _tile_stored
// clobbers all memory, which keeps the fp32 accumulators from living in registers)
#define EDGELLM_TILE_STORE(tile, c)                                                          \
  __asm__ volatile("tilestored %%tmm" #tile ", (%1,%2,1)"                                    \
                   : "=m"(*reinterpret_cast<int32_t(*)[256]>(c))                             \
                   : "r"(static_cast<void*>(c)), "r"(static_cast<int64_t>(64)))

// acc[m] += float(c[m] - zero * corr[m]) * sv * d[m] for the 16 rows of a stored C tile; corr:
// the rows' code sums (int8 codes), d: the rows' steps (strides in elements)
inline void scale_into(__m512 (&acc)[16], const int32_t* c, __m512 sv, const float* d, int64_t ds,
                       const int32_t* lo, const int32_t* hi, int64_t is, int32_t zero) {
  for (int m = 0; m < 16; ++m) {
    __m512i v = _mm512_load_si512(c + 16 * m);
    if (zero != 0) {
      const int32_t corr = lo[m * is] + (hi != nullptr ? hi[m * is] : 0);
      v = _mm512_sub_epi32(v, _mm512_set1_epi32(zero * corr));
    }
    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), sv), _mm512_set1_ps(d[m * ds]), acc[m]);
  }
}

// Outputs of tile t for rows m0 .. m0 + 15 (those below M stored); bt: the tile's B blocks.
template <int BITS, typename S>
void tile_rows(const N16Weights<S>& w, int64_t t, const uint8_t* bt, const QActs& x, int64_t m0, int64_t M,
               float* y, const float* bias) {
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  alignas(64) int32_t c0[256], c1[256];
  const GroupScales<S> scales = w.scales(t);
  const int64_t K = x.K, nb = w.nb, is = 2 * nb;
  const int8_t* a = x.a + m0 * K;
  const float* d = x.d + m0 * nb;
  const int32_t* isum = x.isum + m0 * is;
  if (w.bpg == 0) {  // groups of 16: half blocks
    for (int64_t b = 0; b < nb; ++b) {
      _tile_loadd(3, a + b * QB, K);
      _tile_loadd(4, bt + b * 512, 64);
      _tile_zero(2);
      _tile_dpbsud(2, 3, 4);
      _tile_loadd(3, a + b * QB + 16, K);
      _tile_loadd(4, bt + b * 512 + 256, 64);
      _tile_zero(5);
      _tile_dpbsud(5, 3, 4);
      EDGELLM_TILE_STORE(2, c0);
      EDGELLM_TILE_STORE(5, c1);
      scale_into(acc, c0, load16(scales, 2 * b), d + b, nb, isum + 2 * b, nullptr, is, w.zero);
      scale_into(acc, c1, load16(scales, 2 * b + 1), d + b, nb, isum + 2 * b + 1, nullptr, is, w.zero);
    }
  } else {
    // block b's dot runs on tile set b % 2 (tiles 0, 1 -> 2 or 6, 7 -> 5) and is stored while the
    // sums of block b - 1, stored one step before, are scaled
    auto dot = [&](auto set, int64_t b, int32_t* c) {
      if constexpr (decltype(set)::value == 0) {
        _tile_loadd(0, a + b * QB, K);
        _tile_loadd(1, bt + b * 512, 64);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);
        EDGELLM_TILE_STORE(2, c);
      } else {
        _tile_loadd(6, a + b * QB, K);
        _tile_loadd(7, bt + b * 512, 64);
        _tile_zero(5);
        _tile_dpbsud(5, 6, 7);
        EDGELLM_TILE_STORE(5, c);
      }
    };
    const std::integral_constant<int, 0> set0;
    const std::integral_constant<int, 1> set1;
    int64_t g = 0, left = w.bpg;  // the group of the next block to scale, and its blocks left
    __m512 sv = load16(scales, 0);
    auto scale = [&](int64_t b, const int32_t* c) {
      scale_into(acc, c, sv, d + b, nb, isum + 2 * b, isum + 2 * b + 1, is, w.zero);
      if (--left == 0) {
        left = w.bpg;
        if (++g < w.G) sv = load16(scales, g);
      }
    };
    dot(set0, 0, c0);
    int64_t b = 1;
    for (; b + 2 <= nb; b += 2) {
      dot(set1, b, c1);
      scale(b - 1, c0);
      dot(set0, b + 1, c0);
      scale(b, c1);
    }
    if (b < nb) {
      dot(set1, b, c1);
      scale(b - 1, c0);
      scale(b, c1);
    } else {
      scale(b - 1, c0);
    }
  }
  if (w.offset != nullptr) {
    const GroupScales<S> offs = w.offsets(t);
    for (int64_t g = 0; g < w.G; ++g) {
      const __m512 ov = load16(offs, g);
      for (int m = 0; m < 16; ++m) acc[m] = _mm512_fmadd_ps(ov, _mm512_set1_ps(x.dsum[(m0 + m) * x.G + g]), acc[m]);
    }
  }
  const int64_t n0 = t * N16, valid = std::min<int64_t>(N16, w.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < 16 && m0 + m < M; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * w.N + n0, mask, _mm512_add_ps(acc[m], bv));
}

}  // namespace

bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

template <int BITS, typename S>
void amx_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y,
               const float* bias) {
  static const TileConfig config = make_config();
  thread_local std::vector<uint8_t> strip;  // a tile's int4 / narrow codes unpacked into B tiles
  _tile_loadconfig(&config);
  if (BITS != 8 && static_cast<int64_t>(strip.size()) < w.nb * 512) strip.resize(w.nb * 512);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* bt = w.q + t * w.tile_bytes();
    if constexpr (BITS != 8) {
      for (int64_t b = 0; b < w.nb; ++b) {
        __m512i wv[8];
        unpack_codes_zmm<BITS>(bt + b * w.block_bytes, wv);
        for (int i = 0; i < 8; ++i) _mm512_storeu_si512(strip.data() + b * 512 + 64 * i, wv[i]);
      }
      bt = strip.data();
    }
    for (int64_t m0 = 0; m0 < M; m0 += 16) tile_rows<BITS, S>(w, t, bt, x, m0, M, y, bias);
  }
  _tile_release();
}
#else
bool amx_ready() { return false; }

template <int BITS, typename S>
void amx_tiles(const N16Weights<S>&, int64_t, int64_t, const QActs&, int64_t, float*, const float*) {
  TORCH_CHECK(false, "this build has no AMX tiles");
}
#endif

EDGELLM_N16_INSTANTIATE(amx_tiles)

}  // namespace edgellm::cpu
