// Global -> shared tile copies with cp.async, shared by the kernel families.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device_math.cuh"

namespace fusedattn::cuda {

// Element offset of column `col` (a multiple of 8) of row r in a shared tile
// of unpadded rows of D elements whose 16-byte chunks are XOR-swizzled inside
// each 128-byte line: the chunk's index within its group of 8 (or of the row's
// D / 8, below 64 columns) is XORed with the row's line index, so the 8 rows
// an ldmatrix reads at one column hit 8 different bank groups, and a 128-byte
// line of global memory lands in one 128-byte line of shared memory. With
// padded rows (D + 8) every other line straddles two, and a 16-byte cp.async
// copy of it reaches L2 as more than one request per line.
template <int D>
__host__ __device__ __forceinline__ int swizzled_offset(int r, int col) {
  constexpr int kChunks = D / 8, kGroup = kChunks < 8 ? kChunks : 8, kRowsPerLine = 8 / kGroup;
  static_assert((kChunks & (kChunks - 1)) == 0, "the XOR keeps a chunk in its row only for D / 8 a power of two");
  const int chunk = col / 8;
  return r * D + (chunk / kGroup * kGroup + ((chunk % kGroup) ^ (r / kRowsPerLine % kGroup))) * 8;
}

// Where the copies below put (row, col): rows of Tr::kStride elements, or,
// where Tr sets kSwizzled, swizzled_offset<Tr::kStride>.
template <typename Tr, typename = void>
struct IsSwizzled : std::false_type {};
template <typename Tr>
struct IsSwizzled<Tr, std::void_t<decltype(Tr::kSwizzled)>> : std::bool_constant<Tr::kSwizzled> {};
template <typename Tr>
__device__ __forceinline__ int tile_offset(int r, int col) {
  if constexpr (IsSwizzled<Tr>::value)
    return swizzled_offset<Tr::kStride>(r, col);
  else
    return r * Tr::kStride + col;
}

// The part of a tile that thread `thread` of Tr::kThreads copies: the 16-byte
// chunk at column `col` of rows row, row + kRowStep, row + 2 kRowStep, ...
// Shared by the copies below and by callers that walk the source themselves.
template <typename Tr>
struct RowChunk {
  static constexpr int kRowStep = Tr::kThreads / Tr::kChunksPerRow;
  static_assert(Tr::kThreads % Tr::kChunksPerRow == 0);
  int row, col;
  __device__ __forceinline__ explicit RowChunk(int thread)
      : row(thread / Tr::kChunksPerRow), col(thread % Tr::kChunksPerRow * 8) {}
};

// Copies rows [row0, row0 + Rows) of a [N, d] head into shared memory rows at
// tile_offset<Tr>; rows at or past `valid_rows` are zero-filled (no
// global read; a product with them is 0, which a V tile relies on). Tr gives
// kThreads (the threads that share the copy: the block, or a warp that passes
// its lane as `thread`), kChunksPerRow (d / 8), kStride and optionally
// kSwizzled; L2Prefetch is
// cp_async_16's.
template <int Rows, typename Tr, int L2Prefetch = 0, typename T>
__device__ __forceinline__ void load_rows_async(T* smem, const T* head, int64_t row_stride,
                                                int64_t row0, int64_t valid_rows,
                                                int thread = threadIdx.x) {
  if constexpr (Tr::kThreads % Tr::kChunksPerRow != 0) {
    // A row's chunks do not divide among the threads (d=192: 24 chunks, 128
    // threads): the tile's chunks are dealt out in order instead.
    constexpr int kChunks = Rows * Tr::kChunksPerRow;
    static_assert(kChunks % Tr::kThreads == 0);
#pragma unroll
    for (int i = 0; i < kChunks / Tr::kThreads; ++i) {
      const int c = thread + i * Tr::kThreads;
      const int r = c / Tr::kChunksPerRow, col = c % Tr::kChunksPerRow * 8;
      const bool valid = r < valid_rows;
      cp_async_16<L2Prefetch>(smem + tile_offset<Tr>(r, col), valid ? head + (row0 + r) * row_stride + col : head,
                              valid);
    }
  } else {
    constexpr int kRowStep = RowChunk<Tr>::kRowStep;
    static_assert(Rows % kRowStep == 0);
    const RowChunk<Tr> chunk(thread);
    const T* src = head + (row0 + chunk.row) * row_stride + chunk.col;
#pragma unroll
    for (int i = 0; i < Rows / kRowStep; ++i) {
      const int r = chunk.row + i * kRowStep;
      const bool valid = r < valid_rows;
      cp_async_16<L2Prefetch>(smem + tile_offset<Tr>(r, chunk.col), valid ? src + i * kRowStep * row_stride : head,
                              valid);
    }
  }
}

// load_rows_async for rows that are all valid, with the addressing left to
// the caller: `src` points at this thread's chunk of its first row (its
// RowChunk's row and col) and `row_step` is kRowStep rows of the source, so
// a caller streaming tiles
// advances one pointer per tile: the general version's per-row 64-bit
// multiplies, bounds tests and constant loads are about half of a streaming
// loop's instructions.
template <int Rows, typename Tr, int L2Prefetch = 0, typename T>
__device__ __forceinline__ void load_full_rows_async(T* smem, const T* src, int64_t row_step, int thread) {
  constexpr int kRowStep = RowChunk<Tr>::kRowStep;
  static_assert(Rows % kRowStep == 0);
  const RowChunk<Tr> chunk(thread);
#pragma unroll
  for (int i = 0; i < Rows / kRowStep; ++i)
    cp_async_16<L2Prefetch>(smem + tile_offset<Tr>(chunk.row + i * kRowStep, chunk.col), src + i * row_step, true);
}

}  // namespace fusedattn::cuda
