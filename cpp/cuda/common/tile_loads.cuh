// Global -> shared tile copies with cp.async, shared by the kernel families.
#pragma once

#include <cstdint>

#include "device_math.cuh"

namespace fusedattn::cuda {

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

// Copies rows [row0, row0 + Rows) of a [N, d] head into shared memory rows of
// Tr::kStride elements; rows at or past `valid_rows` are zero-filled (no
// global read; a product with them is 0, which a V tile relies on). Tr gives
// kThreads (the threads that share the copy: the block, or a warp that passes
// its lane as `thread`), kChunksPerRow (d / 8) and kStride; L2Prefetch is
// cp_async_16's.
template <int Rows, typename Tr, int L2Prefetch = 0, typename T>
__device__ __forceinline__ void load_rows_async(T* smem, const T* head, int64_t row_stride,
                                                int64_t row0, int64_t valid_rows,
                                                int thread = threadIdx.x) {
  constexpr int kRowStep = RowChunk<Tr>::kRowStep;
  static_assert(Rows % kRowStep == 0);
  const RowChunk<Tr> chunk(thread);
  const T* src = head + (row0 + chunk.row) * row_stride + chunk.col;
#pragma unroll
  for (int i = 0; i < Rows / kRowStep; ++i) {
    const int r = chunk.row + i * kRowStep;
    const bool valid = r < valid_rows;
    cp_async_16<L2Prefetch>(smem + r * Tr::kStride + chunk.col, valid ? src + i * kRowStep * row_stride : head,
                            valid);
  }
}

// load_rows_async for rows that are all valid, with the addressing left to
// the caller: `src` points at this thread's chunk of its first row (its
// RowChunk's row and col) and `row_step` is kRowStep rows of the source, so
// a caller streaming tiles
// advances one pointer per tile. In the decode kernel the general version's
// per-row 64-bit multiplies, bounds and constant loads were about half of the
// loop's instructions (Nsight Compute, H200, 2026-11-30: 563 per warp and
// tile).
template <int Rows, typename Tr, int L2Prefetch = 0, typename T>
__device__ __forceinline__ void load_full_rows_async(T* smem, const T* src, int64_t row_step, int thread) {
  constexpr int kRowStep = RowChunk<Tr>::kRowStep;
  static_assert(Rows % kRowStep == 0);
  const RowChunk<Tr> chunk(thread);
  T* dst = smem + chunk.row * Tr::kStride + chunk.col;
#pragma unroll
  for (int i = 0; i < Rows / kRowStep; ++i)
    cp_async_16<L2Prefetch>(dst + i * kRowStep * Tr::kStride, src + i * row_step, true);
}

}  // namespace fusedattn::cuda
