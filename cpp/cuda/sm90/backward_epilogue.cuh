// The sm90 backward's per-step epilogue: a consumer's quarter of dQ (64
// queries by 64 columns of d, float32) staged in shared memory and added to
// the float32 accumulator in L2 by tensor reduces (TMA), in deterministic
// mode each at its turn. dK and dV leave at the block's end through
// common/backward_passes.cuh's store_key_gradients.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "../hopper/bulk_copy.cuh"
#include "../hopper/tma.cuh"
#include "../hopper/turns.cuh"
#include "backward_pipeline.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

// Byte offset of dQ quarter element (row, column) in its staging buffer:
// boxes of 32 columns, [64 rows][128 bytes] each, 16-byte chunk j of row r at
// j ^ (r % 8) (the tensor map's 128-byte swizzle).
__device__ __forceinline__ int dq_stage_offset(int row, int column) {
  const int box = column / 32, within = column % 32;
  return box * 64 * 128 + row * 128 + (((within / 4) ^ (row % 8)) * 16) + (within % 4) * 4;
}

// This thread's part of the quarter (rows warp_row + g and + 8, the
// accumulator's layout) to the staging buffer. The box also covers rows past
// the queries (the next head's or sequence's; row r is query first_query + r
// of seqlen_q): they are staged as 0, as their dS is, so that an inf or NaN
// in this block's keys stays in this head's dQ.
__device__ __forceinline__ void stage_dq_quarter(unsigned char* stage, const float (&dq)[8][4], int warp_row, int g,
                                                 int t, int64_t first_query, int64_t seqlen_q) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row + g + 8 * h;
    const bool is_query = first_query + row < seqlen_q;
#pragma unroll
    for (int dt = 0; dt < 8; ++dt)
      store_shared_float2(stage + dq_stage_offset(row, dt * 8 + 2 * t), is_query ? dq[dt][2 * h] : 0.0f,
                          is_query ? dq[dt][2 * h + 1] : 0.0f);
  }
}

// The staged quarter added to the accumulator's rows from `row`, columns
// from column0: one tensor reduce per 32 columns, committed as one group
// (by one thread).
template <typename Tr>
__device__ __forceinline__ void reduce_dq_quarter(const unsigned char* stage, const CUtensorMap* dq_map, int column0,
                                                  int row) {
#pragma unroll
  for (int box = 0; box < 2; ++box) tma_reduce_add_box(stage + box * Tr::kDqBoxBytes, dq_map, column0 + 32 * box, row);
  bulk_commit();
}

// Consumer c's staged dQ tiles of a step added to the accumulator's rows from
// `row`, each tile's 64 columns from the traits' dq_first_column.
template <typename Tr>
__device__ __forceinline__ void reduce_dq_tiles(const Sm90BackwardSmem<Tr>& smem, const CUtensorMap* dq_map,
                                                int consumer, int row) {
  for (int j = 0; j < Tr::dq_tiles(consumer); ++j)
    reduce_dq_quarter<Tr>(smem.dq_stage(consumer) + j * Tr::kDqTileBytes, dq_map,
                          Tr::dq_first_column(consumer) + 64 * j, row);
}

// Deterministic mode's dQ writer (both kernels): warp 1 + c of the producer
// warpgroup takes consumer c's staged tiles of a step (kDqFullBarrier; one at
// d <= 128, one per 64-column slab in the wide kernel), with their turn
// counter, turn and first row (smem.dq_reduce_info, which the consumer's
// issuing thread fills at the step's start: the producer warpgroup's 24
// registers do not hold the walk's arithmetic), waits for the turn, adds the
// tiles by tensor reduces, frees the staging buffer once they have read it
// (kDqEmptyBarrier) and passes the turn on once they are complete: none of
// these waits falls on the consumers' steps, where they cost 26-63% (an
// acquire load, a release, a wait for the reduces to complete).
template <typename Tr>
__device__ __forceinline__ void run_dq_writer(const Sm90BackwardArgs& args, const Sm90BackwardSmem<Tr>& smem,
                                              int steps, int consumer) {
  const bool leader = threadIdx.x % 32 == 0;
  bool lost = false;  // a turn that never came: the call traps at the end
  for (int s = 0; s < steps; ++s) {
    named_barrier_sync(Tr::kDqFullBarrier + consumer, Tr::kDqWriterThreads);
    int* turns = nullptr;
    if (leader) {
      const int32_t* info = smem.dq_reduce_info + 4 * (2 * consumer + s % 2);
      turns = args.p.dq_turns + info[0];
      if (!lost) lost = !wait_for_turn(turns, info[1]);
      reduce_dq_tiles<Tr>(smem, &args.dq_map, consumer, info[2]);
      bulk_wait<0, true>();
    }
    __syncwarp();
    if (s + 1 < steps) named_barrier_arrive(Tr::kDqEmptyBarrier + consumer, Tr::kDqWriterThreads);
    if (leader) {
      bulk_wait<0, false>();
      pass_turn(turns);
    }
  }
  if (lost) __trap();
}

}  // namespace fusedattn::cuda
