// The decode family: forward_kvcache on CUDA. A few queries per sequence
// against a long KV cache is memory bound, so the key range of every
// (sequence, kv head) is split over several thread blocks (flash decoding) and
// the last of them to finish merges their partial results exactly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Head dims this family is instantiated for.
inline constexpr int kDecodeHeadDims[] = {32, 64, 128};
// Upper bound of KVCacheParams::num_splits.
inline constexpr int kMaxDecodeSplits = 64;
// Up to this many splits merge in a thread block cluster (the portable
// cluster size) where the device runs every cluster of the grid at once.
inline constexpr int kMaxClusterSplits = 8;
// A thread block takes kDecodeBlockM (query head, query) rows of one kv head
// and streams its keys in tiles of kDecodeBlockN (4 warps) or a multiple of it
// (the kernel's DecodeTraits); the host counts a cache's work in kDecodeBlockN.
inline constexpr int kDecodeBlockM = 16;
inline constexpr int kDecodeBlockN = 64;

// Blocks per (sequence, kv head, split): the group's Hq / Hkv x Nq rows in
// tiles of kDecodeBlockM.
__host__ __device__ inline int64_t decode_row_tiles(const AttentionShape& sh) {
  return (sh.heads_q / sh.heads_kv * sh.seqlen_q + kDecodeBlockM - 1) / kDecodeBlockM;
}

// (sequence, kv head, row tile) items: the blocks of one split, the clusters
// when the splits merge in clusters, the arrival counters when they do not.
inline int64_t decode_items(const AttentionShape& sh) { return sh.batch * sh.heads_kv * decode_row_tiles(sh); }

// How many blocks to split each (sequence, kv head)'s keys over on the current
// device, for p's shape (p.attn.shape.seqlen_k, the cache size, stands in for
// the lengths, which only the device knows). FUSEDATTN_DECODE_SPLITS=n forces
// n (for benchmarks and tests).
int decode_num_splits(const KVCacheParams& p);

// Whether p's splits (p.num_splits, already chosen) merge in thread block
// clusters on the current device: 2-8 splits, the kernel's sm_90 code, and
// every cluster of the grid running at once (clusters are scheduled whole).
// FUSEDATTN_DECODE_CLUSTER_MERGE: unset, that answer; 0, never; 1, always
// where there is a merge (2 or more splits, a non-empty grid), throwing
// std::invalid_argument where it cannot; any other value throws.
bool decode_merges_in_cluster(const KVCacheParams& p);

// Appends k_new/v_new to the caches, then writes p.attn.out and p.attn.lse on
// `stream`; p.num_splits > 1 without p.merge_in_cluster needs p.partial_out,
// p.partial_lse and p.split_arrivals (zeroed; the kernel leaves it zeroed). A sequence
// whose cache_seqlens[b] + n_new is outside [0, max_len] is not appended to and
// gets NaN outputs (the lengths live on the device; nothing here reads them on
// the host). Throws std::runtime_error on a CUDA error.
void forward_kvcache(const KVCacheParams& p, cudaStream_t stream);

// One instantiation per (head dim, element type), each in its own file.
template <int HeadDim, typename Element>
void launch_decode(const KVCacheParams& p, cudaStream_t stream);
template <int HeadDim, typename Element>
int decode_blocks_per_sm();
// The warps of a decode block on the current device (8, or 4 at d=128 where
// a block cannot hold 8 warps' ring); throws std::invalid_argument for a bad
// FUSEDATTN_DECODE_WARPS.
template <int HeadDim, typename Element>
int decode_warps();
// Clusters of `splits` decode blocks the current device runs at once; 0 where
// the kernel cannot run in clusters (no sm_90 code, or not 2-8 splits).
template <int HeadDim, typename Element>
int decode_max_active_clusters(int splits);

}  // namespace fusedattn::cuda
