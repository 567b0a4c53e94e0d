// The sm90 backward's tile shapes and shared-memory plan, and its kernel
// argument, for the kernel and the host code that launches it.
#pragma once

#include <cuda.h>

#include "../common/block_order.h"
#include "../hopper/register_split.h"
#include "../tile_size.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Deterministic mode's dQ writers (backward_epilogue.cuh's run_dq_writer),
// in both sm90 backward kernels: warp 1 + c of the producer warpgroup adds
// consumer c's staged dQ tiles at their turns. Their named barriers (after
// the kernels' own 1-3), + consumer index: the tiles staged, and their
// staging buffer free again. The load warp beside them spills at 24
// registers (56-80 bytes around each step's loads; docs/cuda-notes.md d5).
struct Sm90DqWriters {
  static constexpr int kDqFullBarrier = 4, kDqEmptyBarrier = 6;
  static constexpr int kDqWriterThreads = 128 + 32;
  static constexpr int kDqReduceInfoBytes = kSm90BackwardConsumers * 2 * 4 * 4;  // 4 ints, 2 steps, per consumer
};

template <int HeadDim>
struct Sm90BackwardTraits : Sm90DqWriters {
  static constexpr int kConsumers = kSm90BackwardConsumers;  // warpgroups of 64 keys
  static constexpr int kThreads = 128 * (1 + kConsumers);    // + the producer
  static constexpr int kBlockN = sm90_backward_block_n(HeadDim);  // keys per block
  static_assert(kBlockN == 64 * kConsumers);
  static constexpr int kBlockM = sm90_backward_block_m(HeadDim);  // queries per step (tile_size.h)
  static constexpr int kStages = 2;                         // of Q, dO, lse, delta
  static constexpr int kSlabs = HeadDim / 64;               // 64-column swizzled slabs per row
  static constexpr int kKVTileBytes = kBlockN * HeadDim * 2;
  static constexpr int kQTileBytes = kBlockM * HeadDim * 2;
  static constexpr int kDsBytes = kBlockM * kBlockN * 2;
  // lse and delta come as 1-D boxes, whose start must sit on 16 bytes (any
  // other start is an illegal instruction on Hopper): each box starts at the
  // multiple of 4 floats at or below the step's first row, so
  // holds 4 more; a ring slot is 2 kBlockM floats, which holds the box and
  // keeps every box 128-byte aligned.
  static constexpr int kRowsBox = kBlockM + 4;
  static constexpr int kRowsSlot = 2 * kBlockM;
  static_assert(kRowsBox <= kRowsSlot);
  // On a step that reads attn_mask, each consumer warp first copies the
  // entries of its 16 keys by the step's queries to shared memory, all its
  // loads in flight at once, in rounds of at most this many bytes.
  static constexpr int kMaskStageBytes = 2048;
  // A consumer's quarter of dQ (64 x 64 floats) is staged for the tensor
  // reduce that adds it to the accumulator: two boxes of [64 rows][32 floats],
  // 128-byte swizzled (the map's layout), which spreads a warp's 8-byte stores
  // over the banks (8 rows in one bank group unswizzled).
  static constexpr int kDqBoxRows = 64;
  static constexpr int kDqBoxBytes = kDqBoxRows * 32 * 4;
  static constexpr int kDqTileBytes = 2 * kDqBoxBytes;
  // K, V, the Q and dO rings, dS double-buffered, the dQ quarters, each slab
  // 1024-byte aligned (the swizzle pattern's period); the warps' mask stages;
  // the lse and delta rings; the mbarriers (K and V; a full and an empty one
  // per stage); each stage's step (3 ints); each consumer's dQ reduces of two
  // steps (4 ints each, deterministic mode); room to align the base.
  static constexpr int kDqOffset = 2 * kKVTileBytes + 2 * kStages * kQTileBytes + 2 * kDsBytes;
  static constexpr int kMaskStageOffset = kDqOffset + kConsumers * kDqTileBytes;
  static constexpr int kFloatsOffset = kMaskStageOffset + 4 * kConsumers * kMaskStageBytes;
  static constexpr int kSmemBytes =
      kFloatsOffset + 2 * kStages * kRowsSlot * 4 + (1 + 2 * kStages) * 8 + kStages * 3 * 4 + kDqReduceInfoBytes + 1024;
  // The forward's split (FA3's): 128 x 24 + 256 x 240 = 384 x 168.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // Deterministic mode's dQ writer warps share the producer's warpgroup, whose
  // load warp ptxas then spills at 24 registers, at 40 not. At d=64 the
  // consumers give 8 of theirs for that; at d=128 they keep 240: with 232 the
  // mode ran 13-15% slower at 8K (docs/cuda-notes.md, deterministic mode d4).
  static constexpr int kOrderedProducerRegisters = HeadDim == 128 ? 24 : 40;
  static constexpr int kOrderedConsumerRegisters = HeadDim == 128 ? 240 : 232;
  static_assert(register_split_fits(kThreads, kProducerRegisters, kConsumerRegisters));
  static_assert(register_split_fits(kThreads, kOrderedProducerRegisters, kOrderedConsumerRegisters));
  static constexpr int kDsWrittenBarrier = 1;  // named barrier of the consumers
  static constexpr int kDqWrittenBarrier = 2;  // + consumer index: each consumer warpgroup's own
  // dK's products queued behind dQ's, so what follows dQ's products runs
  // under them: 5-6% less kernel time at d=128 when dQ was added with
  // reductions per thread (docs/cuda-notes.md, "The sm90 backward, rung 4");
  // at d=64 (128-query steps) ptxas spilled the consumers that way and the
  // kernel ran 2% slower, so dK runs beside dV (not re-measured since rung 5).
  static constexpr bool kDkBehindDq = HeadDim == 128;
  // S^T's and dP^T's products committed apart, and P^T's exponentials run
  // while dP^T's are still on the tensor cores. Not soft-capped: dS^T takes
  // tanh's slope at the capped S^T, which P^T overwrites, and keeping it
  // would cost 32-64 more registers.
  static constexpr bool kExponentialsUnderDp = HeadDim == 128;
  static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of 64-column slabs");
  // dQ = dS K, [kBlockM queries][d] per step, is two 64 x 64 quarters, one
  // per consumer: at d=128 64 columns each, at d=64 64 queries each.
  static_assert(kConsumers == 2 && kBlockM * HeadDim == 2 * 64 * 64);
  // Consumer c's quarter starts at query c kDqQueryOffset, column c kDqColumnOffset.
  static constexpr int kDqQueryOffset = kBlockM == 128 ? 64 : 0;
  static constexpr int kDqColumnOffset = HeadDim == 128 ? 64 : 0;
  // Consumer c's staged dQ tiles (64 x 64 floats each, as the wide kernel's
  // traits name them for the writers): tile c, from column c kDqColumnOffset.
  __host__ __device__ static constexpr int dq_first_tile(int consumer) { return consumer; }
  __host__ __device__ static constexpr int dq_tiles(int) { return 1; }
  __host__ __device__ static constexpr int dq_first_column(int consumer) { return kDqColumnOffset * consumer; }
};

// The kernel's argument: the call's parameters and tensor maps of q, k, v,
// grad_out (4-D, see tensor_maps.h), of lse and delta (flat rows) and of the
// float32 dQ accumulator ([rows][d], added into).
struct Sm90BackwardArgs {
  CUtensorMap q_map, k_map, v_map, do_map, lse_map, delta_map, dq_map;
  BackwardParams p;
  BlockOrder order;        // filled at launch
  int dq_rotation_blocks = 0;  // deterministic mode: filled at launch (dq_rotation_blocks)
};

}  // namespace fusedattn::cuda
