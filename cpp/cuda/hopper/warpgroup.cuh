// Warp specialisation on sm_90a: a warpgroup (4 warps) hands registers to
// another with setmaxnreg, and named barriers order the consumer warpgroups.
#pragma once

namespace fusedattn::cuda {

// The whole warpgroup executes the same call. The kernel's launch bounds must
// fix its register count at entry (ptxas ignores setmaxnreg otherwise), and the
// warpgroups' totals must fit that pool or the increase waits forever
// (register_split_fits, hopper/register_split.h).
template <int Registers>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

// Named barrier `id` (1-15; 0 is __syncthreads) over `threads` threads: sync
// waits for all of them, arrive counts this warp without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// x, the same in every thread of `lanes`, as the compiler's uniform datapath
// sees it: redux.sync writes a uniform register, so what is computed from the
// result (wgmma descriptors, TMA coordinates) stays there instead of being
// moved over with R2UR before each use.
__device__ __forceinline__ unsigned warp_uniform(unsigned x, unsigned lanes) {
  unsigned r;
  asm volatile("redux.sync.max.u32 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(lanes));
  return r;
}

}  // namespace fusedattn::cuda
