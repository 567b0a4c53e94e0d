// Tile sizes of every CUDA family as functions of the call's shape: what the
// kernels' traits take as template arguments and the planner (plan.cu)
// reports and launches by, host and device alike. The figures behind them:
// docs/tuning.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedattn::cuda {

// sm80 forward: 4 warps of 16 query rows, 64-key tiles.
inline constexpr int kSm80Warps = 4;
inline constexpr int kSm80ForwardBlockM = 64;
inline constexpr int kSm80ForwardBlockN = 64;
// sm80 backward: 64 keys per block (16 per warp); queries per step: S^T, dP^T
// (2 x block_m / 2 registers) and dQ's share come on top of dK and dV (d / 2
// registers each per thread): at d=128 a 64-query step would not fit in 255.
inline constexpr int kSm80BackwardBlockN = 64;
inline constexpr int kSm80BackwardBlocksPerSm = 2;  // two fit at d=128 (242 registers)
__host__ __device__ constexpr int sm80_backward_block_m(int head_dim) { return head_dim <= 64 ? 64 : 32; }
// sm80's deterministic dQ pass: 64 queries per block (16 per warp).
inline constexpr int kSm80DqBlockM = 64;

// sm90 forward: consumer warpgroups of 64 queries each, FA3's counts: 3 at
// d=64 (whose S, P and O fit in 160 registers), 2 at d=128, 192 and 256.
__host__ __device__ constexpr int sm90_forward_consumers(int head_dim) { return head_dim == 64 ? 3 : 2; }
__host__ __device__ constexpr int sm90_forward_block_m(int head_dim) { return 64 * sm90_forward_consumers(head_dim); }
// Keys per K/V tile. 176 at d=128 without attn_mask (FA3's tile there: a
// third fewer softmax rounds, barriers and turns per key; S takes 88
// registers); 128 elsewhere: with a mask the consumers spill (ptxas). Banded
// calls (causal, windows) take 176 from kSm90CausalWideTileKeys keys on:
// below, the diagonal's partly hidden tiles (up to 176 + 127 keys of a
// block, against 128 + 127) cost more than the rounds saved. FA3's tiles at
// d=192 and 256, 112 and 80 keys: O takes 96 and 128 registers, and Q with
// two stages of K and V fill 216 and 224 KB of the SM's 227.
inline constexpr int64_t kSm90CausalWideTileKeys = 16384;
__host__ __device__ constexpr int sm90_forward_block_n(int head_dim, bool banded, bool has_mask,
                                                      int64_t seqlen_k) {
  if (head_dim == 256) return 80;
  if (head_dim == 192) return 112;
  if (head_dim != 128 || has_mask) return 128;
  return !banded || seqlen_k >= kSm90CausalWideTileKeys ? 176 : 128;
}
// Blocks that stay resident and take work items until none are left at
// d=128 and above, and at d=64 under causal; else a block per item. A persistent
// block's producer loads the next item's Q and first tiles while the
// consumers finish the last one, which pays most where items are short (d=64
// banded); unbanded d=64 persistent spills (ptxas).
__host__ __device__ constexpr bool sm90_forward_persistent(int head_dim, bool banded) {
  return head_dim >= 128 || banded;
}

// sm90 backward: 2 consumer warpgroups of 64 keys. Queries per step: at d=64
// a step of 64 queries is too little work for its fixed costs (barriers, the
// mbarrier round trip, dQ's reductions); 128 halve those costs per FLOP and
// still fit 240 registers. At d=128 a 64-query step's products are twice as
// large for the same fixed costs.
// Above d=128 a consumer's 64 keys would hold dK and dV in d registers: the
// wide kernel (FA3's orientation there) computes S = Q K^T and dK^T, dV^T
// with the keys as N, 32 per consumer, so that dK^T and dV^T take d / 4
// registers each; 64 keys by 64 queries, with two stages of Q and dO, fill
// 219 KB of shared memory at d=192 (at d=256 dQ skips its staging).
inline constexpr int kSm90BackwardConsumers = 2;
inline constexpr int kSm90BackwardBlocksPerSm = 1;
__host__ __device__ constexpr int sm90_backward_block_m(int head_dim) { return head_dim == 64 ? 128 : 64; }
__host__ __device__ constexpr int sm90_backward_block_n(int head_dim) {
  return head_dim > 128 ? 64 : 64 * kSm90BackwardConsumers;
}

// decode: a block takes kDecodeBlockM (query head, query) rows of one kv head
// and streams its keys in tiles of kDecodeKeysPerWarp keys per warp (so a
// paged cache's pages hold a multiple of them); the host counts a cache's
// work in kDecodeBlockN (4 warps' tile).
inline constexpr int kDecodeBlockM = 16;
inline constexpr int kDecodeKeysPerWarp = 16;
inline constexpr int kDecodeBlockN = 4 * kDecodeKeysPerWarp;
__host__ __device__ constexpr int decode_block_n(int warps) { return kDecodeKeysPerWarp * warps; }

}  // namespace fusedattn::cuda
