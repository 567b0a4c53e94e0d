// The sm90 forward's epilogue, per consumer thread: the head's sink (if any)
// joins the softmax sum, O is normalised once by it and written as T, and
// the row's LSE; rows that saw nothing (l = 0) get out = 0 and lse = -inf.
#pragma once

#include <cstdint>

#include "../common/device_math.cuh"
#include "../common/online_softmax.cuh"
#include "forward_scheduler.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

template <int HeadDim, typename T>
__device__ __forceinline__ void store_output(const ForwardParams& p, const Sm90ForwardItem& it, int row_base, int t,
                                             const float (&acc)[HeadDim / 8][4], const float (&m_i)[2],
                                             const float (&l_i)[2]) {
  constexpr int kDTiles = HeadDim / 8;
  float* lse = p.lse + (int64_t(it.batch) * p.shape.heads_q + it.head) * p.shape.seqlen_q + it.q0;
  T* out = static_cast<T*>(p.out) + it.batch * p.out_strides.batch + it.head * p.out_strides.head +
           int64_t(it.q0) * p.out_strides.row;
  // Without sinks (nearly every call) no row pays for the sink's term.
  const bool has_sink = p.sinks != nullptr;
  const float sink = has_sink ? sink_in_log2(p.sinks, it.head) : 0.0f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = quad_sum(l_i[h]), m = m_i[h];
    const float acc_scale = has_sink ? add_valueless_logit(sink, m, l) : 1.0f;
    const float inv = l > 0.0f ? acc_scale / l : 0.0f;
    const int r = row_base + h * 8;  // the thread's rows: row_base and row_base + 8
    if (r >= it.row0 + it.rows) continue;
    if (t == 0) lse[r] = lse_from_log2(m, l);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<uint32_t*>(out + int64_t(r) * p.out_strides.row + dt * 8 + 2 * t) =
          pack2<T>(acc[dt][2 * h] * inv, acc[dt][2 * h + 1] * inv);
  }
}

}  // namespace fusedattn::cuda
