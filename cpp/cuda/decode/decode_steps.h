// The decode family's helper kernel, launched by forward_kvcache.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Writes k_new/v_new into the caches at cache_seqlens[b] (sequences whose
// length does not fit are left alone).
void launch_append(const KVCacheParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
