// Hopper's bulk copies (cp.async.bulk, done by the tensor memory accelerator)
// and the mbarriers that count their bytes. sm_90 and newer: on older targets
// the functions compile to nothing, and callers must not take that path
// (kHasBulkCopies says which).
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"

namespace fusedattn::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSEDATTN_BULK_COPIES 1
inline constexpr bool kHasBulkCopies = true;
#else
inline constexpr bool kHasBulkCopies = false;
#endif

// Call from one thread, then mbarrier_init_fence(), then sync the block.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals));
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// Makes initialised mbarriers visible to the bulk copies' (async) proxy.
__device__ __forceinline__ void mbarrier_init_fence() {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// Arrives on `bar` and tells it `bytes` more will land through bulk copies.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// One arrival on `bar` (a consumer releasing a buffer).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// Waits until the phase with parity `phase` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory; their arrival completes on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// Orders this thread's earlier shared-memory accesses before later bulk copies
// into the same memory (they go through another proxy).
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  __trap();  // no bulk copies before sm_90: a caller took this path by mistake
#endif
}

// Closes this thread's bulk group: the bulk operations it issued since the last one.
__device__ __forceinline__ void bulk_commit() {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `Pending` of this thread's bulk groups still read their
// shared-memory sources (Read), or are still running at all (!Read).
template <int Pending, bool Read>
__device__ __forceinline__ void bulk_wait() {
#ifdef FUSEDATTN_BULK_COPIES
  if constexpr (Read)
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

// Asks L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) of global
// memory without waiting for them: a hint, so nothing before sm_90.
__device__ __forceinline__ void bulk_prefetch_l2(const void* gmem, uint32_t bytes) {
#ifdef FUSEDATTN_BULK_COPIES
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(gmem), "r"(bytes) : "memory");
#endif
}

}  // namespace fusedattn::cuda
