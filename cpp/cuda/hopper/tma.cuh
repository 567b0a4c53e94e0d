// Tensor-memory-accelerator loads (sm_90a). A head's tile: the tensor map
// (built on the host, tensor_maps.h) describes a [B, H, N, d] operand as the
// 4-D box grid (d, N, H, B); one load brings a box of 64 columns x `rows`
// rows into a 128-byte-swizzled slab and completes its bytes on an mbarrier.
// Rows past N are written as zeros. And a run of a flat float array; and the
// reverse for float32 sums: a box of shared memory added into global memory.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/device_math.cuh"

namespace fusedattn::cuda {

// The map must live in kernel parameter space (a __grid_constant__ argument).
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box at (column, row, head, batch), coordinates in elements.
__device__ __forceinline__ void tma_load_box(void* smem_slab, const CUtensorMap* map, int column, int row, int head,
                                             int batch, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_addr(smem_slab)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(head), "r"(batch), "r"(smem_addr(bar))
      : "memory");
}

// Box at element `index` of a 1-D map (tensor_maps.h's encode_rows_tensor_map).
__device__ __forceinline__ void tma_load_row(void* smem, const CUtensorMap* map, int index, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(
          smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(index), "r"(smem_addr(bar))
      : "memory");
}

// Adds the box at (column, row) of a 2-D float32 map (encode_float_matrix_tensor_map)
// from `smem` into global memory, element by element (the adds happen in L2);
// elements outside the map are dropped. One operation of this thread's bulk
// group (bulk_commit, bulk_wait): `smem` must not change until it has been read.
__device__ __forceinline__ void tma_reduce_add_box(const void* smem, const CUtensorMap* map, int column, int row) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(column), "r"(row), "r"(smem_addr(smem))
               : "memory");
}

}  // namespace fusedattn::cuda
