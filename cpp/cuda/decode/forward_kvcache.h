// The decode family: forward_kvcache on CUDA. A few queries per sequence
// against a long KV cache is memory bound, so the key range of every
// (sequence, kv head) is split over several thread blocks (flash decoding) and
// the last of them to finish merges their partial results exactly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../instantiations.h"
#include "../tile_size.h"
#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// Up to this many splits merge in a thread block cluster (the portable
// cluster size) where the device runs every cluster of the grid at once.
inline constexpr int kMaxClusterSplits = 8;

// The most blocks one launch of the decode kernel takes (a grid's x).
inline constexpr int64_t kMaxDecodeGrid = 2147483647;

// Blocks per (sequence, kv head, split): the group's Hq / Hkv x Nq rows in
// tiles of kDecodeBlockM.
__host__ __device__ inline int64_t decode_row_tiles(const AttentionShape& sh) {
  return (sh.heads_q / sh.heads_kv * sh.seqlen_q + kDecodeBlockM - 1) / kDecodeBlockM;
}

// (sequence, kv head, row tile) items: the blocks of one split, the clusters
// when the splits merge in clusters, the arrival counters when they do not.
inline int64_t decode_items(const AttentionShape& sh) { return sh.batch * sh.heads_kv * decode_row_tiles(sh); }

// Appends k_new/v_new to the caches, then writes p.attn.out and p.attn.lse on
// `stream` with the blocks of `plan` (plan_decode's; p.num_splits and
// p.merge_in_cluster as it says). p.num_splits > 1 without p.merge_in_cluster
// needs p.partial_out, p.partial_lse and p.split_arrivals (zeroed; the kernel
// leaves it zeroed). A sequence whose cache_seqlens[b] + n_new is outside [0,
// max_len] is not appended to and gets NaN outputs (the lengths live on the
// device; nothing here reads them on the host). Throws std::runtime_error on a
// CUDA error.
void forward_kvcache(const KVCacheParams& p, const Plan& plan, cudaStream_t stream);

// One instantiation per (head dim, element type), generate_kernels.py.
template <int HeadDim, typename Element>
void launch_decode(const KVCacheParams& p, const Plan& plan, cudaStream_t stream);
// Whether the kernel's blocks of `warps` warps may be a dependent launch here.
template <int HeadDim, typename Element>
bool decode_dependent_launch(int warps);
// Blocks of `warps` warps resident per SM of the current device.
template <int HeadDim, typename Element>
int decode_blocks_per_sm(int warps);
// Whether the current device holds a block of `warps` warps (4 or 8; 8 only
// at d <= 64).
template <int HeadDim, typename Element>
bool decode_warps_fit(int warps);
// Clusters of `splits` decode blocks the current device runs at once; 0 where
// the kernel cannot run in clusters (no sm_90 code, or not 2-8 splits).
template <int HeadDim, typename Element>
int decode_max_active_clusters(int warps, int splits);

}  // namespace fusedattn::cuda
