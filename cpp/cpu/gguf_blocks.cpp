#include "gguf_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#include "multiversion.h"
#include "tile.h"

namespace fusedattn::cpu {
namespace {

// W is dequantised kTileRows rows at a time. Beyond kFewRows rows of x the
// tile is transposed ([k x kTileRows], the GEMM's B) and one work item is it
// times a slice of at most kSliceRows rows of x, written straight into out.
// Either way every output is one GEMM's sum over k in the same order, so
// among rows padded to a multiple of 8 a row's bits do not depend on m
// (tests/test_gguf_blocks.py checks across kFewRows and the slices).
constexpr int64_t kTileRows = 64;
constexpr int64_t kFewRows = 32;
constexpr int64_t kSliceRows = 256;

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal: mantissa * 2^-24, exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// A block's values from its bytes, one function per format: ggml's layouts
// (block_q4_0 ... block_q6_K), each value computed as gguf-py computes it.
// Inlined, so that they compile for the vector width of dequantize_row's clone.
#define BLOCK_INLINE [[gnu::always_inline]] inline

template <BlockFormat F>
void dequantize_block(const uint8_t* block, float* out);

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q4_0>(const uint8_t* block, float* out) {
  // d * (q - 8), q the low nibbles of 16 bytes, then their high ones.
  const float d = half_to_float(block);
  const uint8_t* q = block + 2;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
    out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
  }
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q4_1>(const uint8_t* block, float* out) {
  // d * q + min
  const float d = half_to_float(block), min = half_to_float(block + 2);
  const uint8_t* q = block + 4;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(q[i] & 0x0f) + min;
    out[i + 16] = d * static_cast<float>(q[i] >> 4) + min;
  }
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q5_0>(const uint8_t* block, float* out) {
  // d * (q - 16): q's low 4 bits as q4_0's, bit 4 of value i bit i of a 32-bit word.
  const float d = half_to_float(block);
  uint32_t high;
  std::memcpy(&high, block + 2, 4);
  const uint8_t* q = block + 6;
  for (int i = 0; i < 16; ++i) {
    const int low = (q[i] & 0x0f) | static_cast<int>(((high >> i) & 1u) << 4);
    const int upper = (q[i] >> 4) | static_cast<int>(((high >> (i + 16)) & 1u) << 4);
    out[i] = d * static_cast<float>(low - 16);
    out[i + 16] = d * static_cast<float>(upper - 16);
  }
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q8_0>(const uint8_t* block, float* out) {
  // d * q, q signed bytes
  const float d = half_to_float(block);
  const auto* q = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
}

// Sub-block j's (of 8) 6-bit scale and minimum in q4_K and q5_K: the low 6
// bits of bytes j and j + 4 for j < 4; else 4 bits of byte j + 4 and the two
// bits bytes j - 4 and j hold above their own 6.
BLOCK_INLINE void k_quant_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// q4_K and q5_K: 8 sub-blocks of 32, value (d * scale) * q - dmin * min; q
// the low or high nibbles of 32 bytes (sub-blocks 2i and 2i + 1 share them),
// with q5_K bit 4 from bit j of 32 more bytes.
template <bool FifthBit>
BLOCK_INLINE void dequantize_k_block(const uint8_t* block, float* out) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* packed = block + 4;
  const uint8_t* high = block + 16;  // q5_K only
  const uint8_t* q = block + (FifthBit ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    k_quant_scale_min(packed, j, scale, min);
    const float ds = d * static_cast<float>(scale), dm = dmin * static_cast<float>(min);
    const uint8_t* nibbles = q + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 32; ++i) {
      int value = (nibbles[i] >> shift) & 0x0f;
      if constexpr (FifthBit) value |= ((high[i] >> j) & 1) << 4;
      out[j * 32 + i] = ds * static_cast<float>(value) - dm;
    }
  }
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q4_K>(const uint8_t* block, float* out) {
  dequantize_k_block<false>(block, out);
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q5_K>(const uint8_t* block, float* out) {
  dequantize_k_block<true>(block, out);
}

template <>
BLOCK_INLINE void dequantize_block<BlockFormat::q6_K>(const uint8_t* block, float* out) {
  // Two halves of 128 values, each 4 runs of 32: (d * scale) * (q - 32), a
  // signed 8-bit scale per 16 values; q's low 4 bits the low or high nibbles
  // of 64 bytes, its high 2 bits a 2-bit field of 32 more.
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_to_float(block + 208);
  for (int half = 0; half < 2; ++half)
    for (int run = 0; run < 4; ++run)
      for (int i = 0; i < 32; ++i) {
        const int nibble = (low[half * 64 + (run % 2) * 32 + i] >> ((run / 2) * 4)) & 0x0f;
        const int q = nibble | (((high[half * 32 + i] >> (2 * run)) & 3) << 4);
        const int p = half * 128 + run * 32 + i;
        out[p] = (d * static_cast<float>(scales[p / 16])) * static_cast<float>(q - 32);
      }
}

template <BlockFormat F>
BLOCK_INLINE void dequantize_row_of(const uint8_t* row, int64_t k, float* out) {
  const int64_t bytes = block_bytes(F), values = block_values(F);
  for (int64_t b = 0; b < k / values; ++b) dequantize_block<F>(row + b * bytes, out + b * values);
}

FUSEDATTN_MULTIVERSION
void dequantize_row(const uint8_t* row, BlockFormat format, int64_t k, float* out) {
  switch (format) {
    case BlockFormat::q4_0: return dequantize_row_of<BlockFormat::q4_0>(row, k, out);
    case BlockFormat::q4_1: return dequantize_row_of<BlockFormat::q4_1>(row, k, out);
    case BlockFormat::q5_0: return dequantize_row_of<BlockFormat::q5_0>(row, k, out);
    case BlockFormat::q8_0: return dequantize_row_of<BlockFormat::q8_0>(row, k, out);
    case BlockFormat::q4_K: return dequantize_row_of<BlockFormat::q4_K>(row, k, out);
    case BlockFormat::q5_K: return dequantize_row_of<BlockFormat::q5_K>(row, k, out);
    case BlockFormat::q6_K: return dequantize_row_of<BlockFormat::q6_K>(row, k, out);
  }
}

// Rows dequantised together before their transposition: kGroupRows rows of
// k floats stay in L1 while each column of them becomes a contiguous run.
constexpr int64_t kGroupRows = 16;

// out[r, :] = the values of row r of blocks, for r < rows, on the calling thread.
void dequantize_serial(const uint8_t* blocks, int64_t rows, int64_t row_bytes, BlockFormat format, int64_t k,
                       float* out) {
  for (int64_t r = 0; r < rows; ++r) dequantize_row(blocks + r * row_bytes, format, k, out + r * k);
}

// wt[j * rows + r] = W[r, j] for the tile's rows; group: kGroupRows * k floats.
FUSEDATTN_MULTIVERSION
void dequantize_transposed(const uint8_t* blocks, int64_t rows, int64_t row_bytes, BlockFormat format, int64_t k,
                           float* group, float* wt) {
  for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
    const int64_t count = std::min(kGroupRows, rows - r0);
    dequantize_serial(blocks + r0 * row_bytes, count, row_bytes, format, k, group);
    // Column by column (not tile.h's transpose, row by row): each write is a run of `count`.
    for (int64_t j = 0; j < k; ++j)
      for (int64_t r = 0; r < count; ++r) wt[j * rows + r0 + r] = group[r * k + j];
  }
}

}  // namespace

int64_t block_values(BlockFormat format) {
  switch (format) {
    case BlockFormat::q4_0:
    case BlockFormat::q4_1:
    case BlockFormat::q5_0:
    case BlockFormat::q8_0: return 32;
    case BlockFormat::q4_K:
    case BlockFormat::q5_K:
    case BlockFormat::q6_K: return 256;
  }
  return 0;
}

int64_t block_bytes(BlockFormat format) {
  switch (format) {
    case BlockFormat::q4_0: return 2 + 16;
    case BlockFormat::q4_1: return 2 + 2 + 16;
    case BlockFormat::q5_0: return 2 + 4 + 16;
    case BlockFormat::q8_0: return 2 + 32;
    case BlockFormat::q4_K: return 2 + 2 + 12 + 128;
    case BlockFormat::q5_K: return 2 + 2 + 12 + 32 + 128;
    case BlockFormat::q6_K: return 128 + 64 + 16 + 2;
  }
  return 0;
}

void dequantize_rows(const uint8_t* blocks, int64_t rows, int64_t row_bytes, BlockFormat format, int64_t k,
                     float* out) {
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    dequantize_serial(blocks + begin * row_bytes, end - begin, row_bytes, format, k, out + begin * k);
  });
}

void block_linear(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t n, int64_t row_bytes,
                  BlockFormat format, float* out) {
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  if (m <= kFewRows) {
    // Few rows (decoding): out^T = W x^T, W's rows dequantised as they lie,
    // not transposed, which at these sizes costs more than the GEMM.
    std::vector<float> xt(k * m);
    const Matrix x_t = transpose(x, m, k, k, xt, m);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(kTileRows * k), product(kTileRows * m);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t row0 = tile * kTileRows, rows = std::min(kTileRows, n - row0);
        dequantize_serial(blocks + row0 * row_bytes, rows, row_bytes, format, k, w.data());
        matmul(rows, m, k, {w.data(), k}, x_t, product.data(), m, /*accumulate=*/false);
        for (int64_t i = 0; i < m; ++i)  // row by row of out: each write a run of `rows`
          for (int64_t r = 0; r < rows; ++r) out[i * n + row0 + r] = product[r * m + i];
      }
    });
    return;
  }
  // out[slice, tile] = x[slice] W[tile]^T, straight into out.
  const int64_t slices = (m + kSliceRows - 1) / kSliceRows;
  at::parallel_for(0, tiles * slices, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> group(kGroupRows * k), wt(k * kTileRows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / slices, slice = item % slices;
      const int64_t row0 = tile * kTileRows, rows = std::min(kTileRows, n - row0);
      const int64_t i0 = slice * kSliceRows, slice_rows = std::min(kSliceRows, m - i0);
      if (item == begin || slice == 0)  // a new tile of W (items of one tile are consecutive)
        dequantize_transposed(blocks + row0 * row_bytes, rows, row_bytes, format, k, group.data(), wt.data());
      matmul(slice_rows, rows, k, {x + i0 * k, k}, {wt.data(), rows}, out + i0 * n + row0, n,
             /*accumulate=*/false);
    }
  });
}

}  // namespace fusedattn::cpu
