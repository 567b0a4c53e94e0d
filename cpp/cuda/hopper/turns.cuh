// Turns in global memory: an int counts the turns taken at one shared
// resource, and a block whose turn is r waits until it reads r, does its work
// (a tensor reduce: the async proxy) and, once that is complete, passes the
// turn on. The sm90 backward's deterministic mode orders the key blocks' dQ
// adds into each query tile this way. sm_90 and newer (the proxy fences).
#pragma once

namespace fusedattn::cuda {

// A wait this long means no block will ever pass the turn on (a rank that
// disagrees with the walk's visits): give up rather than hang the device,
// and let the caller trap later (a trap in the wait loop made ptxas spill
// the sm90 backward's accumulators). About 10 s of acquire loads.
inline constexpr unsigned kMaxTurnPolls = 1u << 26;

// Waits until *turns == turn (an acquire), then orders this thread's later
// bulk operations (the async proxy) after what the last holder wrote; false
// when it gave up.
__device__ __forceinline__ bool wait_for_turn(const int* turns, int turn) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (unsigned polls = 0;; ++polls) {
    int seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(turns) : "memory");
    if (seen == turn) break;
    if (polls == kMaxTurnPolls) return false;
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  return true;
#else
  __trap();  // no async proxy before sm_90: a caller took this path by mistake
  return false;
#endif
}

// Passes the turn on (a release), after this thread's completed bulk
// operations (bulk_wait without .read) and its own writes.
__device__ __forceinline__ void pass_turn(int* turns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(turns) : "memory");
#else
  __trap();  // no async proxy before sm_90: a caller took this path by mistake
#endif
}

}  // namespace fusedattn::cuda
