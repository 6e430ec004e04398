// Activations quantized for the integer-dot matmuls (qacts.cpp): per row and 32-column block to
// int8, llama.cpp's Q8_0 rule. Shared by qgemm.cpp (the row layout) and qgemm_n16.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace edgellm::cpu {

constexpr int64_t QB = 32;  // activation block (columns)

// Quantized activations of M rows (pointers into caller-owned buffers).
struct QActs {
  const int8_t* a;       // [M, K] codes
  const float* d;        // [M, K / 32] step per block
  const float* dsum;     // [M, G]: per weight group, sum over its blocks of d_b * sum(a_b)
  const int32_t* isum;   // [M, K / 16] integer sum of each half block's codes, or nullptr
  int64_t K, nb, G;
};

// One row of K columns: a = round-to-nearest-even(x / d), d = absmax / 127 per block (0 codes
// where d == 0); dsum per group of `group` columns (group 16: per half block); isum (if not
// nullptr) the integer sum of each half block's codes.
void quantize_row(const float* x, int64_t K, int64_t group, int8_t* a, float* d, float* dsum, int32_t* isum);

// Rows [0, M) of x [M, K] (row stride K) over torch's threads into buffers of at least M rows.
void quantize_into(const float* x, int64_t M, int64_t K, int64_t group, int8_t* a, float* d, float* dsum,
                   int32_t* isum);

// Buffers that live as long as the calling thread: a call quantizes into them instead of
// allocating (a fresh allocation of a large step's codes is an mmap whose page faults
// serialise a process's threads). Valid until the same thread's next call.
struct ActScratch {
  std::vector<int8_t> a;
  std::vector<float> d, dsum;
  std::vector<int32_t> isum;
  // quantize x [M, K] into rows [0, M) and zero rows [M, rows) (rows >= M: padding for tiles)
  QActs quantize(const float* x, int64_t M, int64_t rows, int64_t K, int64_t group);
};
ActScratch& act_scratch();

}  // namespace edgellm::cpu
