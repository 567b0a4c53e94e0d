// The wide sm90 backward's products (d above 128), per consumer warpgroup and
// step; the block's keys are the products' N, its consumer's 32 keys:
//   S  = Q K^T,  dP = dO V^T     m64n32k16: rows = the step's 64 queries
//   dV^T += dO^T P               m64n32k16 per 64 columns of d: A = dO read
//   dK^T += Q^T  dS              transposed, B = P (dS) as this consumer's
//                                rows of the [key][query] P^T (dS^T) tile
//   dQ  = dS K                   m64n{64 slabs}k16 over the block's 64 keys, for
//                                this consumer's slabs of d: A = dS^T read
//                                transposed, B = K read transposed
// P^T and dS^T go to shared memory (the kernel's stmatrix) because here they
// are B operands. Each product is issued, not committed or waited for.
#pragma once

#include "../hopper/wgmma.cuh"
#include "backward_pipeline.cuh"
#include "backward_wide_traits.h"

namespace fusedattn::cuda {

template <int HeadDim, typename T, typename Tr>
struct Sm90WideBackwardMma {
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kKeys = Tr::kKeysPerConsumer;
  static constexpr int kChunks = HeadDim / 64;  // of dK^T and dV^T: 64 rows of d each
  const Sm90BackwardSmem<Tr>& smem;
  int consumer;  // its keys are rows kKeys consumer.. of K, V, P^T and dS^T

  // S and dP of this consumer's keys.
  __device__ __forceinline__ void scores(float (&s_flat)[kKeys / 2], float (&dp_flat)[kKeys / 2],
                                         const unsigned char* q_tile, const unsigned char* do_tile) const {
    const unsigned char* k_mine = smem.k + consumer * kKeys * 128;
    const unsigned char* v_mine = smem.v + consumer * kKeys * 128;
    fence_registers(s_flat);
    fence_registers(dp_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kKeys>(s_flat, k_major_descriptor(q_tile, kBlockM, kk), k_major_descriptor(k_mine, kBlockN, kk),
                         kk > 0);
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kKeys>(dp_flat, k_major_descriptor(do_tile, kBlockM, kk), k_major_descriptor(v_mine, kBlockN, kk),
                         kk > 0);
  }

  // acc^T += A^T X for every 64 columns of d: A the step's dO (Q), [query][d];
  // X this consumer's rows of P^T (dS^T), [key][query] (dK^T scaled at the end).
  __device__ __forceinline__ void key_gradient_product(float (&acc)[kChunks][kKeys / 2], const unsigned char* a_tile,
                                                       const unsigned char* x_tile) const {
    const unsigned char* x_mine = x_tile + consumer * kKeys * 128;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) fence_registers(acc[j]);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
#pragma unroll
      for (int kq = 0; kq < kBlockM / 16; ++kq)
        wgmma_ss<T, kKeys, /*TransB=*/false, /*TransA=*/true>(
            acc[j], mn_major_descriptor(a_tile + j * kBlockM * 128, kBlockM, kq),
            k_major_descriptor(x_mine, kBlockN, kq), true);
  }

  // dQ's columns 64 first_slab.. (Slabs slabs) of the step: dS K over the block's keys.
  template <int Slabs>
  __device__ __forceinline__ void query_gradient(float (&dq_flat)[Slabs * 32], const unsigned char* dst_tile,
                                                 int first_slab) const {
    const unsigned char* k_slabs = smem.k + first_slab * kBlockN * 128;
    fence_registers(dq_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_ss<T, 64 * Slabs, /*TransB=*/true, /*TransA=*/true>(
          dq_flat, mn_major_descriptor(dst_tile, kBlockN, kk), mn_major_descriptor(k_slabs, kBlockN, kk), kk > 0);
  }
};

}  // namespace fusedattn::cuda
