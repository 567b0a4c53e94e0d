// The order in which a flat grid of tiles visits them: `pairs` units of work
// (a (batch, query head) pair, or a (batch, K/V head, head split)), each cut
// into `blocks_per_pair` blocks (query blocks, or key blocks). Shared by every
// kernel with such a grid: the sm80 and sm90 forwards and the sm80 dQ pass
// (query blocks), the sm80 and sm90 backwards (key blocks).
//
// Pairs go in groups of `pairs_per_group` consecutive ones. Inside a group the
// index runs over the pairs fastest and the blocks slowest, so the blocks
// resident at one time are the group's and share its operands in L2. Under a
// causal mask the block that sees the most keys (or queries) comes first: the
// longest work is launched first and the shortest fills the tail of each
// group (a longest-processing-time order, as FA3 schedules causal work). One
// pair per group is the plain order, blocks fastest.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fusedattn/params.h"
#include "launch_check.h"

namespace fusedattn::cuda {

struct GridBlock {
  unsigned pair, block;
};

struct BlockOrder {
  unsigned blocks_per_pair = 0;
  unsigned pairs = 0;
  unsigned pairs_per_group = 1;  // >= 1

  // The tile at flat index `index` < blocks(); Reverse: block ranks from the
  // last block (causal query blocks: the last sees the most keys). The last
  // group may hold fewer pairs than the others.
  template <bool Reverse>
  __host__ __device__ GridBlock at(unsigned index) const {
    const unsigned group_blocks = pairs_per_group * blocks_per_pair;
    const unsigned group = index / group_blocks, within = index % group_blocks;
    const unsigned first_pair = group * pairs_per_group;
    const unsigned group_pairs = pairs - first_pair < pairs_per_group ? pairs - first_pair : pairs_per_group;
    const unsigned rank = within / group_pairs;
    return {first_pair + within % group_pairs, Reverse ? blocks_per_pair - 1 - rank : rank};
  }

  __host__ __device__ int64_t blocks() const { return int64_t(blocks_per_pair) * pairs; }
};

// The order of a launch. With `group_for_l2` (causal calls, whose blocks
// differ in length) as many pairs go in a group as keep the operands they
// share, `bytes_per_pair` each, within half the L2; otherwise (blocks of one
// length) one pair per group. Throws when the grid does not fit one launch;
// `what` names it in the message.
inline BlockOrder make_block_order(int64_t pairs, int64_t blocks_per_pair, int64_t bytes_per_pair,
                                   bool group_for_l2, const char* what) {
  if (pairs * blocks_per_pair > 2147483647)
    throw std::runtime_error(std::string("fusedattn: ") + what + " exceeds one launch (2^31 - 1 blocks)");
  int64_t pairs_per_group = 1;
  if (group_for_l2 && pairs > 1) {
    int device = 0, l2_bytes = 0;
    FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
    if (bytes_per_pair > 0) pairs_per_group = int64_t(l2_bytes) / 2 / bytes_per_pair;
    pairs_per_group = std::clamp<int64_t>(pairs_per_group, 1, pairs);
  }
  return {static_cast<unsigned>(blocks_per_pair), static_cast<unsigned>(pairs),
          static_cast<unsigned>(pairs_per_group)};
}

// Query blocks of block_m rows over B x Hq pairs (pair = batch * Hq + head);
// a pair shares its K/V head's tiles with the rest of its GQA group.
inline BlockOrder make_query_block_order(const AttentionShape& sh, int block_m, int element_bytes,
                                         bool is_causal) {
  return make_block_order(sh.batch * sh.heads_q, (sh.seqlen_q + block_m - 1) / block_m,
                          2 * sh.seqlen_k * sh.head_dim * element_bytes / sh.group_size(), is_causal,
                          "B x Hq x query blocks");
}

// Key blocks of block_n keys over B x Hkv x head_splits pairs (pair =
// (batch * Hkv + head_kv) * head_splits + split); a pair shares Q, dO, lse
// and delta of its split's query heads.
inline BlockOrder make_key_block_order(const AttentionShape& sh, int block_n, int head_splits, int element_bytes,
                                       bool is_causal) {
  const int64_t heads_per_split = sh.group_size() / head_splits;
  return make_block_order(sh.batch * sh.heads_kv * head_splits, (sh.seqlen_k + block_n - 1) / block_n,
                          heads_per_split * sh.seqlen_q * (2 * sh.head_dim * element_bytes + 8), is_causal,
                          "B x Hkv x head splits x key blocks");
}

}  // namespace fusedattn::cuda
