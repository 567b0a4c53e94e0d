// The sm90 backward's shared memory and the mbarrier pipeline between its
// producer and consumers: K and V once per block (kv_full), a two-stage ring
// of Q, dO, lse and delta per step ("full": the bytes landed; "empty": every
// consumer warp is done reading), dS double-buffered (backward_traits.h's plan).
#pragma once

#include <cstdint>

#include "../hopper/bulk_copy.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <typename Tr>
struct Sm90BackwardSmem {
  unsigned char *k, *v;   // [128 keys][d], 64-column slabs of 128 rows
  unsigned char *q, *dO;  // stage i at i * kQTileBytes, [kBlockM queries][d]
  unsigned char* ds;      // buffer b at b * kDsBytes: [kBlockM queries][128 keys]
  float *lse, *delta;     // stage i at i * kRowsSlot; lse in natural log
  uint64_t *kv_full, *step_full, *step_empty;

  __device__ __forceinline__ explicit Sm90BackwardSmem(unsigned char* raw) {
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023);  // the swizzle's period
    unsigned char* base = reinterpret_cast<unsigned char*>(aligned);
    k = base;
    v = k + Tr::kKVTileBytes;
    q = v + Tr::kKVTileBytes;
    dO = q + Tr::kStages * Tr::kQTileBytes;
    ds = dO + Tr::kStages * Tr::kQTileBytes;
    lse = reinterpret_cast<float*>(base + Tr::kFloatsOffset);
    delta = lse + Tr::kStages * Tr::kRowsSlot;
    kv_full = reinterpret_cast<uint64_t*>(delta + Tr::kStages * Tr::kRowsSlot);
    step_full = kv_full + 1;
    step_empty = step_full + Tr::kStages;
  }

  // By one thread, before the block's first __syncthreads.
  __device__ __forceinline__ void init_barriers() const {
    mbarrier_init(kv_full, 1);
    for (int i = 0; i < Tr::kStages; ++i) {
      mbarrier_init(&step_full[i], 1);
      mbarrier_init(&step_empty[i], 4 * Tr::kConsumers);  // every consumer warp
    }
    mbarrier_init_fence();
  }

  // Step s's ring stage and that stage's phase parity.
  static __device__ __forceinline__ int stage(int s) { return s % Tr::kStages; }
  static __device__ __forceinline__ uint32_t phase(int s) { return static_cast<uint32_t>((s / Tr::kStages) & 1); }
};

}  // namespace fusedattn::cuda
