// The sm90 forward's shared memory and the mbarrier pipeline between its
// producer and consumers: Q, a two-stage ring of K tiles and one of V tiles
// (forward_traits.h's plan), "full" barriers (the bytes landed) and "empty"
// ones (every consumer warp is done reading).
// Every item starts its tiles at stage 0 of both rings, so that stages (and
// the wgmma descriptors made from them) follow from j alone, which the
// compiler keeps in uniform registers (continuing the rings across items
// moves that work to the vector pipe, with many more R2UR moves, and runs
// slower); RingPhases carries each stage's phase parity from item to item.
// Q is released with the item's last K tile, so the next item's first tiles
// cannot be needed earlier than the stage they wait for.
#pragma once

#include <cstdint>

#include "../hopper/bulk_copy.cuh"
#include "../hopper/ring_phases.cuh"
#include "forward_traits.h"

namespace fusedattn::cuda {

template <typename Tr>
struct Sm90ForwardSmem {
  unsigned char *q, *k, *v;  // ring stage s at s * kTileBytes
  uint64_t *q_full, *q_empty, *k_full, *k_empty, *v_full, *v_empty;
  // The index of the item whose Q is in q (n_items: no more work), written by
  // the producer before it arrives on q_full.
  volatile unsigned* item_slot;

  __device__ __forceinline__ explicit Sm90ForwardSmem(unsigned char* raw) {
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023);  // the swizzle's period
    unsigned char* base = reinterpret_cast<unsigned char*>(aligned);
    q = base;
    k = q + Tr::kQBytes;
    v = k + Tr::kStages * Tr::kTileBytes;
    q_full = reinterpret_cast<uint64_t*>(base + Tr::kBarriersOffset);
    q_empty = q_full + 1;
    k_full = q_empty + 1;
    k_empty = k_full + Tr::kStages;
    v_full = k_empty + Tr::kStages;
    v_empty = v_full + Tr::kStages;
    item_slot = reinterpret_cast<volatile unsigned*>(v_empty + Tr::kStages);
  }

  // By one thread, before the block's first __syncthreads.
  __device__ __forceinline__ void init_barriers() const {
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, 4 * Tr::kConsumers);  // every consumer warp
    for (int s = 0; s < Tr::kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], 4 * Tr::kConsumers);
      mbarrier_init(&v_empty[s], 4 * Tr::kConsumers);
    }
    mbarrier_init_fence();
  }
};

}  // namespace fusedattn::cuda
