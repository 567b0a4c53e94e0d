// Global -> shared tile copies with cp.async, shared by the kernel families.
#pragma once

#include <cstdint>

#include "device_math.cuh"

namespace fusedattn::cuda {

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
  // Thread i copies chunk i % kChunksPerRow of rows i / kChunksPerRow + n * kRowStep.
  constexpr int kRowStep = Tr::kThreads / Tr::kChunksPerRow;
  static_assert(Tr::kThreads % Tr::kChunksPerRow == 0 && Rows % kRowStep == 0);
  const int r0 = thread / Tr::kChunksPerRow, col = thread % Tr::kChunksPerRow * 8;
  const T* src = head + (row0 + r0) * row_stride + col;
#pragma unroll
  for (int i = 0; i < Rows / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool valid = r < valid_rows;
    cp_async_16<L2Prefetch>(smem + r * Tr::kStride + col, valid ? src + i * kRowStep * row_stride : head,
                            valid);
  }
}

}  // namespace fusedattn::cuda
