// The sm90 backward's shared memory (backward_traits.h's plan) and the
// mbarrier pipeline between its producer and consumers: K and V once ("kv
// full"), then a two-stage ring of each step's Q, dO, lse and delta ("step
// full": the bytes landed; "step empty": every consumer warp is done reading):
// the walk is one run of the ring (RingPhases from 0), step s at stage s % kStages.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "../hopper/bulk_copy.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <typename Tr>
struct Sm90BackwardSmem {
  unsigned char *k, *v;     // [kBlockN keys][d], 64-column slabs of kBlockN rows
  unsigned char *q, *d_o;   // ring stage s at s * kQTileBytes, [kBlockM queries][d]
  unsigned char* ds;        // buffer b at b * kDsBytes: [kBlockM queries][kBlockN keys]
  unsigned char* dq;        // staged dQ tile t at t * kDqTileBytes (traits' dq_first_tile)
  unsigned char* mask;      // consumer warp w's mask stage at w * kMaskStageBytes
  float *lse, *delta;       // ring stage s at s * kRowsSlot; lse in natural log
  uint64_t *kv_full, *step_full, *step_empty;
  // A listed walk's steps (head, first query, reads attn_mask) per stage: the
  // producer reads the mask's list and hands each step over with its data.
  int32_t* step_info;
  // Deterministic mode: consumer c's dQ tiles of step s, their turn counter,
  // turn and first row at 4 (2 c + s % 2), for its dQ writer warp.
  int32_t* dq_reduce_info;

  // Consumer c's staged dQ tiles (traits' dq_first_tile, dq_tiles).
  __device__ __forceinline__ unsigned char* dq_stage(int consumer) const {
    return dq + Tr::dq_first_tile(consumer) * Tr::kDqTileBytes;
  }

  __device__ __forceinline__ explicit Sm90BackwardSmem(unsigned char* raw) {
    // Aligned to the swizzle's period by an offset from raw, not through an
    // integer, so that the compiler still sees shared memory (lds, not
    // generic loads, for lse, delta and the mask stages).
    unsigned char* base = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    k = base;
    v = k + Tr::kKVTileBytes;
    q = v + Tr::kKVTileBytes;
    d_o = q + Tr::kStages * Tr::kQTileBytes;
    ds = d_o + Tr::kStages * Tr::kQTileBytes;
    dq = base + Tr::kDqOffset;
    mask = base + Tr::kMaskStageOffset;
    lse = reinterpret_cast<float*>(base + Tr::kFloatsOffset);
    delta = lse + Tr::kStages * Tr::kRowsSlot;
    kv_full = reinterpret_cast<uint64_t*>(delta + Tr::kStages * Tr::kRowsSlot);
    step_full = kv_full + 1;
    step_empty = step_full + Tr::kStages;
    step_info = reinterpret_cast<int32_t*>(step_empty + Tr::kStages);
    dq_reduce_info = step_info + 3 * Tr::kStages;
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
};

}  // namespace fusedattn::cuda
