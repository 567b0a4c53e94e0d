// The sm90 forward's tile shapes and shared-memory plan, and its kernel
// argument, for the kernel and the host code that launches it.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/block_order.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Keys per K/V tile. 176 at d=128 without attn_mask (FA3's tile there: a
// third fewer softmax rounds, barriers and turns per key; S takes 88
// registers); 128 elsewhere: with a mask the consumers spill (ptxas). Causal
// calls take 176 from kSm90CausalWideTileKeys keys on: below, the diagonal's
// partly hidden tiles (up to 176 + 127 keys of a block, against 128 + 127)
// cost more than the rounds saved (docs/tuning.md).
inline constexpr int64_t kSm90CausalWideTileKeys = 16384;
constexpr int sm90_forward_block_n(int head_dim, bool is_causal, bool has_mask, int64_t seqlen_k) {
  if (head_dim != 128 || has_mask) return 128;
  return !is_causal || seqlen_k >= kSm90CausalWideTileKeys ? 176 : 128;
}

// Blocks that stay resident and take work items until none are left
// (forward_kernel.cuh) at d=128, and at d=64 under causal; else a block per
// item. A persistent block's producer loads the next item's Q and first
// tiles while the consumers finish the last one, which pays most where items
// are short (d=64 causal); non-causal d=64 persistent spills (ptxas) and
// keeps a block per item. Figures: docs/tuning.md.
template <int HeadDim, bool IsCausal>
inline constexpr bool kSm90Persistent = HeadDim == 128 || IsCausal;

template <int HeadDim, int BlockN>
struct Sm90ForwardTraits {
  // Consumer warpgroups of 64 queries each: FA3's counts, 3 at d=64 (whose
  // S, P and O fit in 160 registers), 2 at d=128.
  static constexpr int kConsumers = HeadDim == 64 ? 3 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = 2;                         // per ring (K and V)
  static constexpr int kSlabs = HeadDim / 64;               // 64-column swizzled slabs per row
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kTileBytes = kBlockN * HeadDim * 2;  // one K or V tile
  // Producer and consumers split the SM's 65536 registers; ptxas gives every
  // thread 65536 / kThreads at entry (168 or 128), setmaxnreg moves them:
  // 128 x 24 + 256 x 240 = 384 x 168 and 128 x 24 + 384 x 160 <= 512 x 128.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumers == 3 ? 160 : 240;
  static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536,
                "setmaxnreg would wait forever for registers the SM does not have");
  // Q, the K ring and the V ring, each slab 1024-byte aligned (the swizzle
  // pattern's period); then the mbarriers (Q full and empty, and full and
  // empty per stage of each ring) and the current item's index; plus room to
  // align the base.
  static constexpr int kBarriersOffset = kQBytes + 2 * kStages * kTileBytes;
  static constexpr int kSmemBytes = kBarriersOffset + (2 + 4 * kStages) * 8 + 4 + 1024;
  static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of 64-column slabs");
  static_assert(BlockN == 128 || (BlockN == 176 && HeadDim == 128), "S, P and O of a 176-key tile fit at d=128 only");
};

// The kernel's argument: the call's parameters, a tensor map per input and
// the order of the query blocks (filled at launch).
struct Sm90ForwardArgs {
  CUtensorMap q_map, k_map, v_map;
  ForwardParams p;
  BlockOrder order;
};

}  // namespace fusedattn::cuda
