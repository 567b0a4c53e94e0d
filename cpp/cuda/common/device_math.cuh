// Small device helpers shared by the CUDA kernel families: element types,
// tensor-core fragments (mma.sync m16n8k16, ldmatrix) and cp.async.
// Fragment layouts follow the PTX ISA's "Matrix fragments for mma.m16n8k16":
// with lane = 4 * g + t, a thread holds rows g and g + 8 and columns 2t, 2t + 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fusedattn::cuda {

// Packs two floats into the 32-bit register of a 16-bit element pair.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// d (16x8, f32) += a (16x16, row) * b (16x8, col)
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// addr[0] = x, addr[1] = y in shared memory (addr 8-byte aligned), as st.shared:
// through a generic pointer the compiler may not see the state space.
__device__ __forceinline__ void store_shared_float2(void* addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(smem_addr(addr)), "f"(x), "f"(y) : "memory");
}

// Four 8x8 matrices of 16-bit elements; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// The same, each matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// acc (16 x Cols, m16n8 accumulators) += a (an m16n8k16 A fragment: 16 rows
// by 16 of the contraction) times rows first_row.. first_row + 15 of `tile`
// (row-major in shared memory, Stride elements per row), Cols columns, read
// transposed: the P V-shaped product of the sm80 backward (dV += P^T dO,
// dK += dS^T Q, dQ += dS K). The sm80 forward's P V keeps its own loop (one B
// fragment serves all its query tiles), and so does decode's (through this
// helper its d=32/64 SASS changes, and the change is untimed).
template <typename T, int Cols, int Stride>
__device__ __forceinline__ void mma_a_times_rows(float (&acc)[Cols / 8][4], const uint32_t (&a)[4], const T* tile,
                                                 int first_row, int lane) {
#pragma unroll
  for (int dp = 0; dp < Cols / 16; ++dp) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, tile + (first_row + (lane & 7) + (((lane >> 3) & 1) << 3)) * Stride + dp * 16 + (lane >> 4 << 3));
    mma_16x8x16<T>(acc[2 * dp], a, b[0], b[1]);
    mma_16x8x16<T>(acc[2 * dp + 1], a, b[2], b[3]);
  }
}

// 16-byte global -> shared copy that bypasses registers; writes zeros when
// !valid. L2Prefetch = 128 asks L2 to fetch the surrounding 128 bytes from
// memory in one request.
template <int L2Prefetch = 0>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  static_assert(L2Prefetch == 0 || L2Prefetch == 128, "the kernels use no other L2 prefetch size");
  if constexpr (L2Prefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(valid ? 16 : 0));
  }
}

// 4-byte global -> shared copy (one float); writes zero when !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `pending` committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// addr[0] += x, addr[1] += y in global memory (addr 8-byte aligned), with no
// result: one 8-byte reduction from sm_90 on, two float atomics before.
__device__ __forceinline__ void red_add_float2(float* addr, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(addr, x);
  atomicAdd(addr + 1, y);
#endif
}

// Reduction over the 4 lanes (t = 0..3) that share a row of a fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Reduction over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffff, x, offset);
  return x;
}

}  // namespace fusedattn::cuda
