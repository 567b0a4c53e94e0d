// Device helpers shared by the decode family's kernels.
#pragma once

#include <cstdint>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Sequence b's length after the append, or -1 when its cache_seqlens entry
// does not fit the cache (its outputs are then NaN).
__device__ __forceinline__ int64_t kv_length(const KVCacheParams& p, int64_t b) {
  const int64_t cached = p.cache_seqlens[b];
  return cached >= 0 && cached + p.n_new <= p.attn.shape.seqlen_k ? cached + p.n_new : -1;
}

// Where row `row` of [B, Hq, Nq] starts in p.attn.out.
__device__ __forceinline__ int64_t output_offset(const ForwardParams& a, int64_t row) {
  const AttentionShape& sh = a.shape;
  const int64_t batch = row / (sh.heads_q * sh.seqlen_q);
  const int64_t head = row / sh.seqlen_q % sh.heads_q, query = row % sh.seqlen_q;
  return batch * a.out_strides.batch + head * a.out_strides.head + query * a.out_strides.row;
}

}  // namespace fusedattn::cuda
