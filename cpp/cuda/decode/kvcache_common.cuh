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

}  // namespace fusedattn::cuda
