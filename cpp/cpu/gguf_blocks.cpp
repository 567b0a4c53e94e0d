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

FUSEDATTN_MULTIVERSION
void dequantize_row(const uint8_t* row, BlockFormat format, int64_t k, float* out) {
  const int64_t bytes = block_bytes(format);
  for (int64_t b = 0; b < k / kBlockValues; ++b, row += bytes, out += kBlockValues) {
    const float d = half_to_float(row);
    switch (format) {
      case BlockFormat::q4_0: {  // d * (q - 8), q the low nibbles then the high ones
        const uint8_t* q = row + 2;
        for (int i = 0; i < 16; ++i) {
          out[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
          out[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
        }
        break;
      }
      case BlockFormat::q4_1: {  // d * q + min
        const float min = half_to_float(row + 2);
        const uint8_t* q = row + 4;
        for (int i = 0; i < 16; ++i) {
          out[i] = d * static_cast<float>(q[i] & 0x0f) + min;
          out[i + 16] = d * static_cast<float>(q[i] >> 4) + min;
        }
        break;
      }
      case BlockFormat::q8_0: {  // d * q, q signed bytes
        const auto* q = reinterpret_cast<const int8_t*>(row + 2);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
        break;
      }
    }
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

int64_t block_bytes(BlockFormat format) {
  switch (format) {
    case BlockFormat::q4_0: return 2 + 16;
    case BlockFormat::q4_1: return 2 + 2 + 16;
    case BlockFormat::q8_0: return 2 + 32;
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
