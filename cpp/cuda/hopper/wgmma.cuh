// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): shared-memory matrix
// descriptors for 128-byte-swizzled tiles and the instruction shapes the sm90
// kernels use (generated: wgmma_instructions.cuh). Facts and sources: docs/hopper-notes.md.
//
// A 128-byte-swizzled tile of R rows x 64 16-bit columns stores row r at byte
// 128 r, its 16-byte chunk c at ((c ^ (r % 8)) * 16): the hardware XORs
// address bits [6:4] with [9:7], so every tile starts on a 1024-byte boundary.
// Wider rows are stored as 64-column slabs of R x 128 bytes, one after another.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "wgmma_instructions.cuh"

namespace fusedattn::cuda {

// Byte offset of the 16-byte chunk `chunk` (8 elements) of row r in a
// 128-byte-swizzled tile of `rows` rows.
__device__ __forceinline__ uint32_t swizzled_chunk_offset(int r, int chunk, int rows) {
  return (chunk / 8) * rows * 128 + r * 128 + (((chunk % 8) ^ (r % 8)) << 4);
}

// The 64-bit matrix descriptor: start address, leading and stride byte
// offsets (all in 16-byte units), layout type 1 = 128-byte swizzle.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t smem_byte_addr, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  return uint64_t((smem_byte_addr & 0x3FFFF) >> 4) | uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16 |
         uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32 | uint64_t(1) << 62;
}

// Descriptor of k-step kk (16 columns) of a K-major operand: a tile of `rows`
// rows (M or N) by the contraction dimension, 128-byte swizzled. Inside a
// 64-column slab a step moves 32 bytes; every 4 steps the next slab.
__device__ __forceinline__ uint64_t k_major_descriptor(const void* tile, int rows, int kk) {
  return smem_descriptor(smem_addr(tile) + (kk % 4) * 32 + (kk / 4) * rows * 128, /*leading, unused*/ 16,
                         /*8-row groups*/ 1024);
}

// Descriptor of k-step kk (16 rows along the contraction) of an MN-major
// operand stored [k][n] (or [k][m]) with 64-column slabs of `k_rows` rows: 16 rows are
// 2048 bytes; slabs (n 0-63, 64-127) are k_rows x 128 bytes apart.
__device__ __forceinline__ uint64_t mn_major_descriptor(const void* tile, int k_rows, int kk) {
  return smem_descriptor(smem_addr(tile) + kk * 2048, /*next 64 columns*/ k_rows * 128, /*8 k-rows*/ 1024);
}

// Orders this warpgroup's register writes before the next wgmma (needed before
// the first one and whenever accumulators or A fragments were touched).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// Keeps the compiler from moving reads or writes of these registers across
// the asynchronous wgmma: call on its accumulators and A fragments before
// wgmma_fence() and after wgmma_wait().
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// d (64 x N, f32) (+)= A (64 x 16) B (16 x N), both in shared memory: each
// K-major, or with TransA (TransB) MN-major, stored [k][m] ([k][n]).
template <typename T, int N, bool TransB = false, bool TransA = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  Wgmma<T, N>::template ss<TransA, TransB>(d, desc_a, desc_b, accumulate);
}

// d (64 x N, f32) (+)= A (64 x 16, registers: the mma.sync A fragment of each
// warp's 16 rows) B (16 x N, shared memory, MN-major: stored [k][n]).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  Wgmma<T, N>::template rs<1>(d, a, desc_b, accumulate);
}

// Four 8x8 matrices of 16-bit elements from registers (each lane's pair as
// ldmatrix would have delivered it) to shared memory, transposed: lanes
// 8i..8i+7 give the addresses of matrix i's rows after the transpose.
__device__ __forceinline__ void stmatrix_x4_trans(const uint32_t (&r)[4], void* row_addr) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace fusedattn::cuda
