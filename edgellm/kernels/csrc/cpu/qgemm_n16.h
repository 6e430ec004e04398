// Integer-dot matmuls over weights interleaved 16 output rows at a time (qgemm_n16.cpp, and
// qgemm_amx.cpp for AMX tiles).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <type_traits>

#include "qacts.h"

namespace edgellm::cpu {

// The layout ("n16"; edgellm/kernels/reference.pack_int_n16_ref is its statement). Output rows
// are taken 16 at a time (a tile t: rows 16 t .. 16 t + 15, rows past N hold code 0 and scale 0),
// and each 32-column block b of a tile is the B operand of an AMX int8 dot product: 8 rows of 64
// bytes, row r holding for each of the 16 outputs n the four codes of columns 4 r .. 4 r + 3:
//   e[r * 64 + n * 4 + j] = code(16 t + n, 32 b + 4 r + j),
// int8 codes stored as code + 128 (unsigned), so AVX-512 VNNI's vpdpbusd and AMX's tdpbsud take
// them with the signed activations (the + 128 is taken back out exactly, in integers, by the
// activations' block sums); int4 codes (0..15) packed two to a byte: byte i = e[i] | e[i + 256] << 4.
// Narrow int8 codes (5 or 6 bits: GGUF Q5_0/Q6_K and the K-quants as int8 codes) keep the int4
// bytes for bits 0-3 of e (256 bytes), then one 64-byte plane per higher bit: plane byte j holds
// bit 4 (and, for 6 bits, the next plane bit 5) of e[64 k + j] in its bit k, k = 0..7 (layout
// row k). Stored codes are unsigned: e = code + n16_zero(bits) (int8: + 128; 5 bits: + 16; 6
// bits: + 32; int4: the codes as they are), or + n16_other_zero(bits) (int4 -8..7: + 8; 5-bit 0..31:
// as they are); the kernels subtract the zero in integers, from the activations' half-block sums.
// qweight [NT, K / 32, n16_block_bytes(bits)] uint8; scale and offset [NT, G, 16] fp32 or fp16,
// or both in the compact form (int8 [NT, G * 16 + B * 64], GGUF's K-quants, whose group scales and
// minimums are a small integer times an fp16 per 256 columns): per tile the int8 multipliers
// [G, 16], then B bases [B, 16] as fp32 bytes, each shared by gps = G / B consecutive groups; the
// value of group g, output n is float(mult[g][n]) * base[g / gps][n] (exact in fp32, so equal to
// the fp32 form's values). B follows from the tensor's size.
constexpr int64_t N16 = 16;
constexpr int64_t n16_block_bytes(int64_t bits) { return bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : 512; }
constexpr int32_t n16_zero(int bits) { return bits == 4 ? 0 : 1 << (bits - 1); }
// The other zero a width may be stored with: int4 codes -8..7 stored + 8 (symmetric int4: GGUF Q4_0,
// GPTQ's symmetric codes, W = scale * code with no offset), 5-bit codes 0..31 stored as they are
// (GGUF Q5_1 and Q5_K); -1 where there is none.
constexpr int32_t n16_other_zero(int bits) { return bits == 4 ? 8 : bits == 5 ? 0 : -1; }
// The width of int8-kind codes (5, 6 or 8) from their block size (n16_block_bytes' inverse).
constexpr int64_t n16_int8_bits(int64_t block_bytes) {
  return block_bytes == n16_block_bytes(5) ? 5 : block_bytes == n16_block_bytes(6) ? 6 : 8;
}

// One tile's group scales (or offsets): S = float or c10::Half, the values [G, 16]; S = int8_t,
// the compact form's multipliers [G, 16] and their bases [G / gps, 16]. v == nullptr: none (a
// weight without offsets).
template <typename S>
struct GroupScales {
  const S* v;
  const float* base;  // int8_t only
  int64_t gps;        // int8_t only: groups per base
  float at(int64_t g, int64_t n) const {  // the value of group g, output n
    if constexpr (std::is_same_v<S, int8_t>) return static_cast<float>(v[g * 16 + n]) * base[g / gps * 16 + n];
    else return static_cast<float>(v[g * 16 + n]);
  }
};

template <typename S>
struct N16Weights {
  const uint8_t* q;
  const S* scale;   // [NT, scale_tile]
  const S* offset;  // [NT, scale_tile] or nullptr
  int64_t NT, nb, G, bpg, N;  // bpg: blocks per group (0: groups of 16, int8/narrow codes only)
  int64_t tile_bytes() const { return nb * block_bytes; }
  int64_t block_bytes;  // n16_block_bytes(bits)
  int64_t gps = 0;      // the compact form's groups per base (S = int8_t), else 0
  int32_t zero = 0;     // what was added to the codes to store them (n16_zero(bits), or n16_zeros' other)
  // elements of S per tile of scales: G * 16, or for the compact form G * 16 + (G / gps) * 64
  int64_t scale_tile() const { return gps > 0 ? G * 16 + G / gps * 64 : G * 16; }
  GroupScales<S> tile_scales(const S* p, int64_t t) const {
    if (p == nullptr) return {nullptr, nullptr, gps};
    const S* v = p + t * scale_tile();
    return {v, gps > 0 ? reinterpret_cast<const float*>(v + G * 16) : nullptr, gps};
  }
  GroupScales<S> scales(int64_t t) const { return tile_scales(scale, t); }
  GroupScales<S> offsets(int64_t t) const { return tile_scales(offset, t); }  // v == nullptr: none
};

// A tile is read front to back, one stream per thread: more than the hardware prefetcher keeps in
// flight. The tile functions prefetch every 64-byte line of the block N16_PREFETCH_BYTES ahead of
// the one they read (benchmarks/cpu_int_dot.py measures the read rate at one row; the README
// gives what a one-line prefetch 1 KB ahead cost).
constexpr int64_t N16_PREFETCH_BYTES = 4096;
inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(block + N16_PREFETCH_BYTES + line, 0, 3);
}

// y [M, N] fp32 = x W^T (+ bias) with W as the row layout's contract (qgemm.h) in the n16 layout
// above; `n` = N; bits 4, 5, 6 or 8 (5 and 6: int8 codes within -16..15 or -32..31, stored narrow);
// zero: what the stored codes hold on top of the codes, n16_zero(bits) (-1 says that) or
// n16_other_zero(bits).
// Rows run as AMX tiles when M >= amx_rows and the build and the OS allow AMX,
// else by VNNI dot products (AVX-512 VNNI or AVX-VNNI builds), AVX2's vpmaddubsw or scalar code;
// the integer block dots are exact either way, so every path returns the same sums up to fp32 summation order.
at::Tensor int_linear_n16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                          const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias, int64_t n,
                          int64_t amx_rows, int64_t zero = -1);
at::Tensor int_linear_n16_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                             const at::Tensor& offset, int64_t bits, int64_t group, const at::Tensor& bias,
                             int64_t n, int64_t amx_rows, int64_t zero);

// Outputs y[m, 16 t + n] (+ bias) for tiles [t0, t1) and all M rows, by vpdpbusd where the build
// has it (one definition per build: qgemm_n16_zmm.cpp, qgemm_n16_ymm.cpp), else by vpmaddubsw
// (qgemm_n16_avx2.cpp), else in scalar code (qgemm_n16_scalar.cpp).
template <int BITS, typename S>
void n16_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y,
               const float* bias);

// Explicit instantiations of a tile function with n16_tiles' signature for the (bits, scale type)
// pairs the op dispatches to; each defining file names its function once.
#define EDGELLM_N16_INSTANTIATE_BITS(fn, bits)                                                          \
  template void fn<bits, float>(const N16Weights<float>&, int64_t, int64_t, const QActs&, int64_t, float*, \
                                const float*);                                                            \
  template void fn<bits, c10::Half>(const N16Weights<c10::Half>&, int64_t, int64_t, const QActs&, int64_t, \
                                    float*, const float*);                                                \
  template void fn<bits, int8_t>(const N16Weights<int8_t>&, int64_t, int64_t, const QActs&, int64_t, float*, \
                                 const float*);
#define EDGELLM_N16_INSTANTIATE(fn)    \
  EDGELLM_N16_INSTANTIATE_BITS(fn, 4) \
  EDGELLM_N16_INSTANTIATE_BITS(fn, 5) \
  EDGELLM_N16_INSTANTIATE_BITS(fn, 6) \
  EDGELLM_N16_INSTANTIATE_BITS(fn, 8)

// Which n16_tiles this build holds: "avx512-vnni", "avx-vnni", "avx2" or "scalar".
const char* n16_variant();

// Whether this build and this process can run AMX tiles (the build has AMX-INT8 and the kernel
// granted the tile state; asked once).
bool amx_ready();

// The AMX path for tiles [t0, t1) and all M rows (qgemm_amx.cpp; x padded to a multiple of 16
// rows with zero codes). Only called when amx_ready().
template <int BITS, typename S>
void amx_tiles(const N16Weights<S>& w, int64_t t0, int64_t t1, const QActs& x, int64_t M, float* y,
               const float* bias);

}  // namespace edgellm::cpu
