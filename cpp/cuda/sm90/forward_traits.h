// The sm90 forward's tile shapes and shared-memory plan, and its kernel
// argument, for the kernel and the host code that launches it.
#pragma once

#include <cuda.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

template <int HeadDim>
struct Sm90ForwardTraits {
  static constexpr int kConsumers = 2;                      // warpgroups of 64 queries
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;                         // per ring (K and V)
  static constexpr int kSlabs = HeadDim / 64;               // 64-column swizzled slabs per row
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kTileBytes = kBlockN * HeadDim * 2;  // one K or V tile
  // Producer and consumers split the 65536 registers of the SM (FA3's 24/240;
  // 128 x 24 + 256 x 240 = 384 x 168, the count ptxas gives at entry).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // Q, the K ring and the V ring, each slab 1024-byte aligned (the swizzle
  // pattern's period); then the mbarriers; plus room to align the base.
  static constexpr int kBarriersOffset = kQBytes + 2 * kStages * kTileBytes;
  static constexpr int kSmemBytes = kBarriersOffset + (1 + 4 * kStages) * 8 + 1024;
  static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of 64-column slabs");
};

// The kernel's argument: the call's parameters and a tensor map per input.
struct Sm90ForwardArgs {
  CUtensorMap q_map, k_map, v_map;
  ForwardParams p;
};

}  // namespace fusedattn::cuda
