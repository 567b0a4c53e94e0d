// Thread block clusters (sm_90+): the blocks of a cluster run at the same time
// on one GPC and can read each other's shared memory (distributed shared
// memory). On older targets the functions trap, and callers must not launch
// in clusters there.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"

namespace fusedattn::cuda {

// Every thread of every block of the cluster waits here; shared-memory
// writes made before it are visible to the whole cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
#else
  __trap();  // no clusters before sm_90: a caller took this path by mistake
#endif
}

// The address of `p` (this block's shared memory) in block `rank`'s shared
// memory, for ld_cluster.
__device__ __forceinline__ uint32_t cluster_address(const void* p, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(address) : "r"(smem_addr(p)), "r"(rank));
  return address;
#else
  __trap();  // no clusters before sm_90: a caller took this path by mistake
  return 0;
#endif
}

__device__ __forceinline__ float ld_cluster_f32(uint32_t address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  float x;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(address) : "memory");
  return x;
#else
  __trap();  // no clusters before sm_90: a caller took this path by mistake
  return 0.0f;
#endif
}

// 16 bytes, 16-byte aligned.
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
               : "r"(address)
               : "memory");
  return x;
#else
  __trap();  // no clusters before sm_90: a caller took this path by mistake
  return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#endif
}

}  // namespace fusedattn::cuda
