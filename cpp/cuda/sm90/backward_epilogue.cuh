// The sm90 backward's epilogue of a step, per consumer thread: its share of
// dQ (a 64 x 64 quarter of the step's, mma.sync's C layout per warp) added
// to the float32 accumulator with 8-byte reductions, rows past the queries
// left out. dK and dV leave at the end of the walk through
// common/backward_passes.cuh's store_key_gradients.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// `row_base` is the thread's first row within the step (its second is 8 on),
// `column0` the quarter's first column of d.
template <int HeadDim>
__device__ __forceinline__ void add_query_gradient(const BackwardParams& p, unsigned batch, int64_t head, int64_t m0,
                                                   int row_base, int column0, int t, const float (&dq)[8][4]) {
  const AttentionShape& sh = p.fwd.shape;
  float* accum = p.grad_q_accum + ((int64_t(batch) * sh.heads_q + head) * sh.seqlen_q + m0) * HeadDim + column0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_base + 8 * h;  // the query, within the step
    if (m0 + r >= sh.seqlen_q) continue;
#pragma unroll
    for (int dt = 0; dt < 8; ++dt)
      red_add_float2(accum + r * HeadDim + dt * 8 + 2 * t, dq[dt][2 * h], dq[dt][2 * h + 1]);
  }
}

}  // namespace fusedattn::cuda
