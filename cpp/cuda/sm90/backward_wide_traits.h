// The sm90 backward's tiles above d=128 (backward_wide_kernel.cuh) and their
// shared-memory plan, in the names Sm90BackwardSmem and Sm90BackwardLoad read.
#pragma once

#include <type_traits>

#include "../hopper/register_split.h"
#include "../tile_size.h"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <int HeadDim>
struct Sm90WideBackwardTraits : Sm90DqWriters {
  static_assert(HeadDim % 64 == 0 && HeadDim > 128, "wgmma tiles of 64-column slabs, above d=128");
  static constexpr int kConsumers = kSm90BackwardConsumers;  // warpgroups, each a share of the block's keys
  static constexpr int kThreads = 128 * (1 + kConsumers);    // + the producer
  static constexpr int kBlockN = sm90_backward_block_n(HeadDim);  // keys per block (tile_size.h)
  static constexpr int kKeysPerConsumer = kBlockN / kConsumers;
  static constexpr int kBlockM = sm90_backward_block_m(HeadDim);  // queries per step
  static_assert(kBlockM == 64 && kBlockN == 64, "S, P^T and dS^T tiles of 64 x 64");
  static constexpr int kStages = 2;           // of Q, dO, lse, delta
  static constexpr int kSlabs = HeadDim / 64;  // 64-column swizzled slabs per row
  static constexpr int kKVTileBytes = kBlockN * HeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * HeadDim * 2;
  // One [key][query] tile of P^T or dS^T; dS^T double-buffered (both
  // consumers read it for dQ), P^T once (each consumer reads its own rows).
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kPtOffset = 2 * kDsBytes;  // from smem.ds
  // lse and delta boxes as in Sm90BackwardTraits.
  static constexpr int kRowsBox = kBlockM + 4;
  static constexpr int kRowsSlot = 2 * kBlockM;
  // dQ = dS K, [64 queries][d] per step, by 64-column slabs: consumer 0 takes
  // the first kDqSlabs0, consumer 1 the rest, each staged as a tile of two
  // boxes of [64 rows][32 floats] (128-byte swizzled) for the tensor reduce.
  static constexpr int kDqSlabs0 = (kSlabs + 1) / 2, kDqSlabs1 = kSlabs - kDqSlabs0;
  // At d=256 the staging (64 KB) does not fit beside two stages of Q and dO:
  // each thread adds its dQ elements to the accumulator by reductions instead
  // (so no deterministic mode there: its writers add staged tiles).
  static constexpr bool kDqByReductions = HeadDim > 192;
  static constexpr int kDqBoxRows = 64;
  static constexpr int kDqBoxBytes = kDqBoxRows * 32 * 4;
  static constexpr int kDqTileBytes = 2 * kDqBoxBytes;
  // Consumer c's staged tiles, one per slab, for the deterministic mode's writers.
  __host__ __device__ static constexpr int dq_first_tile(int consumer) { return consumer == 0 ? 0 : kDqSlabs0; }
  __host__ __device__ static constexpr int dq_tiles(int consumer) { return consumer == 0 ? kDqSlabs0 : kDqSlabs1; }
  __host__ __device__ static constexpr int dq_first_column(int consumer) { return 64 * dq_first_tile(consumer); }
  // K, V, the Q and dO rings, dS^T twice and P^T, the dQ tiles (each 1024-byte
  // aligned), the lse and delta rings, the mbarriers, each stage's step (3
  // ints: the loader writes them for listed walks only), the writers' dQ
  // reduces (deterministic mode), room to align the base.
  static constexpr int kDqOffset = 2 * kKVTileBytes + 2 * kStages * kQTileBytes + 3 * kDsBytes;
  static constexpr int kMaskStageOffset = kDqOffset + (kDqByReductions ? 0 : kSlabs * kDqTileBytes);  // no attn_mask
  static constexpr int kFloatsOffset = kMaskStageOffset;
  static constexpr int kSmemBytes = kFloatsOffset + 2 * kStages * kRowsSlot * 4 + (1 + 2 * kStages) * 8 +
                                    kStages * 3 * 4 + kDqReduceInfoBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "an H100's shared memory per block");
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // Deterministic mode's writer warps share the producer's warpgroup, whose
  // load warp ptxas spills at 24 registers (56-80 bytes), at 40 not.
  static constexpr int kOrderedProducerRegisters = 40;
  static constexpr int kOrderedConsumerRegisters = 232;
  static_assert(register_split_fits(kThreads, kProducerRegisters, kConsumerRegisters));
  static_assert(register_split_fits(kThreads, kOrderedProducerRegisters, kOrderedConsumerRegisters));
  static constexpr int kDsWrittenBarrier = 1;  // named barrier of the consumers
  static constexpr int kDqWrittenBarrier = 2;  // + consumer index
};

// The traits of the kernel that runs head dim d.
template <int HeadDim>
using Sm90BackwardTraitsOf =
    std::conditional_t<(HeadDim > 128), Sm90WideBackwardTraits<HeadDim>, Sm90BackwardTraits<HeadDim>>;

}  // namespace fusedattn::cuda
