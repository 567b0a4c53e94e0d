// The sm90 backward's softmax step, per consumer thread, on S^T and dP^T
// (element (key row g + 8h, query column 2t + e) of each n-tile: mma.sync's
// C layout):
//   P^T  = 2^(S^T scale log2 e - lse log2 e),  dS^T = P^T (dP^T - delta)
// with the keys past the end, the queries past the end and (causal) the keys
// above the diagonal hidden; then both packed as the A operands of the key
// gradients' GEMMs.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/device_math.cuh"
#include "../common/online_softmax.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// st and dpt become P^T and dS^T for the 64 keys from key0 (this thread's
// rows from key0 + row_base) and the step's BlockM queries from m0 (its
// columns from m0 + 2t), lse and delta read at the step's columns. Free
// function, 32-bit positions (the planner keeps lengths at most 2^30): a struct holding the
// shape, or 64-bit positions, cost 4-8% more instructions or a spill at d=64.
template <int BlockM, bool IsCausal>
__device__ __forceinline__ void backward_probabilities(float (&st)[BlockM / 8][4], float (&dpt)[BlockM / 8][4],
                                                       const float* lse, const float* delta, int seqlen_q, int seqlen_k,
                                                       float scale_log2, int key0, int m0, int row_base,
                                                       int t) {
  const int causal_offset = seqlen_k - seqlen_q;  // query i sees key j iff j <= i + causal_offset
  const bool needs_masking = key0 + 64 > seqlen_k || m0 + BlockM > seqlen_q ||
                             (IsCausal && key0 + 63 > m0 + causal_offset);
#pragma unroll
  for (int nt = 0; nt < BlockM / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = row_base + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
      // A hidden entry is 0 in P^T and dS^T outright: past the queries, lse
      // and delta are the next head's, and a NaN there must not reach dK.
      bool hidden = false;
      if (needs_masking) {
        const int key = key0 + r, query = m0 + c;
        hidden = key >= seqlen_k || query >= seqlen_q || (IsCausal && key > query + causal_offset);
      }
      const float prob = hidden ? 0.0f : exp2f(st[nt][e] * scale_log2 - lse_in_log2(lse[c]));
      st[nt][e] = prob;
      dpt[nt][e] = hidden ? 0.0f : prob * (dpt[nt][e] - delta[c]);
    }
  }
}

// P^T and dS^T as wgmma A fragments of T, one per 16 queries.
template <int BlockM, typename T>
__device__ __forceinline__ void pack_probabilities(uint32_t (&p_a)[BlockM / 16][4], uint32_t (&ds_a)[BlockM / 16][4],
                                                   const float (&st)[BlockM / 8][4], const float (&dpt)[BlockM / 8][4]) {
#pragma unroll
  for (int kq = 0; kq < BlockM / 16; ++kq) {
    probabilities_as_a<T>(p_a[kq], st, kq);
    probabilities_as_a<T>(ds_a[kq], dpt, kq);
  }
}

}  // namespace fusedattn::cuda
