// The sm90 forward's tile shapes and shared-memory plan, and its kernel
// argument, for the kernel and the host code that launches it.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/block_order.h"
#include "../hopper/register_split.h"
#include "../tile_size.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Tile sizes, tile_size.h: consumer warpgroups (sm90_forward_consumers),
// keys per tile (sm90_forward_block_n), persistent blocks (sm90_forward_persistent).
template <int HeadDim, int BlockN>
struct Sm90ForwardTraits {
  static constexpr int kConsumers = sm90_forward_consumers(HeadDim);  // of 64 queries each
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer
  static constexpr int kBlockM = sm90_forward_block_m(HeadDim);
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = 2;                         // per ring (K and V)
  static constexpr int kSlabs = HeadDim / 64;               // 64-column swizzled slabs per row
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kTileBytes = kBlockN * HeadDim * 2;  // one K or V tile
  // Producer and consumers split what the block got at launch (168 or 128 a
  // thread): 128 x 24 + 256 x 240 = 384 x 168 and 128 x 24 + 384 x 160 <= 512 x 128.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumers == 3 ? 160 : 240;
  static_assert(register_split_fits(kThreads, kProducerRegisters, kConsumerRegisters));
  // Q, the K ring and the V ring, each slab 1024-byte aligned (the swizzle
  // pattern's period); then the mbarriers (Q full and empty, and full and
  // empty per stage of each ring) and the current item's index; plus room to
  // align the base.
  static constexpr int kBarriersOffset = kQBytes + 2 * kStages * kTileBytes;
  static constexpr int kSmemBytes = kBarriersOffset + (2 + 4 * kStages) * 8 + 4 + 1024;
  static_assert(HeadDim % 64 == 0 && HeadDim <= 256, "wgmma tiles of 64-column slabs");
  static_assert(HeadDim == 256   ? BlockN == 80
                : HeadDim == 192 ? BlockN == 112
                                 : BlockN == 128 || (BlockN == 176 && HeadDim == 128),
                "S, P and O fit in the consumers' registers: 176-key tiles at d=128 only, 112 at 192, 80 at 256");
  static_assert(kSmemBytes <= 227 * 1024, "Q and the rings exceed a block's shared memory");
};

// The kernel's argument: the call's parameters, a tensor map per input and
// the order of the query blocks (filled at launch).
struct Sm90ForwardArgs {
  CUtensorMap q_map, k_map, v_map;
  ForwardParams p;
  BlockOrder order;
};

}  // namespace fusedattn::cuda
