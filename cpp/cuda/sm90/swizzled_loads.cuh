// cp.async loads into the 128-byte-swizzled tiles wgmma reads (wgmma.cuh's
// layout), for kernels that do not use the tensor memory accelerator.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "wgmma.cuh"

namespace fusedattn::cuda {

// Rows [row0, row0 + Rows) of a [N, HeadDim] head (16-bit elements, rows
// row_stride elements apart) into a swizzled tile of Rows rows; rows at or
// past valid_rows are written as zeros. Every one of the Threads threads calls it.
template <int Rows, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void load_swizzled_async(unsigned char* tile, const T* head, int64_t row_stride,
                                                    int64_t row0, int64_t valid_rows) {
  constexpr int kChunksPerRow = HeadDim / 8;
  for (int i = threadIdx.x; i < Rows * kChunksPerRow; i += Threads) {
    const int r = i / kChunksPerRow, chunk = i % kChunksPerRow;
    const bool valid = r < valid_rows;
    cp_async_16(tile + swizzled_chunk_offset(r, chunk, Rows), valid ? head + (row0 + r) * row_stride + chunk * 8 : head,
                valid);
  }
}

}  // namespace fusedattn::cuda
