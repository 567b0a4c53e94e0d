// The order in which a grid of query blocks (B x Hq x ceil(Nq / block_m),
// one flat index) visits the (batch, query head, query block) triples: shared
// by every kernel whose block owns query rows (the sm80 and sm90 forwards, the
// sm80 dQ pass).
//
// Heads go in groups of `heads_per_group` consecutive (batch, head) pairs.
// Inside a group the index runs over the heads fastest and the query blocks
// slowest, so the blocks resident at one time are the group's and share its
// K and V in L2. Causal blocks are visited last block first: those see the
// most keys, so the longest work is launched first and the shortest fills the
// tail of each group (a longest-processing-time order; FA3 schedules causal
// work the same way). One head per group is the plain order, query blocks
// fastest.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

struct QueryBlock {
  unsigned batch, head, m_block;
};

struct QueryBlockOrder {
  unsigned m_blocks = 0;         // query blocks per (batch, head)
  unsigned heads_q = 0;          // Hq, to split a (batch, head) pair
  unsigned pairs = 0;            // B x Hq
  unsigned heads_per_group = 1;  // (batch, head) pairs per group, >= 1

  // The triple of the block at flat index `index` < blocks(). The last group
  // may hold fewer pairs than the others.
  template <bool IsCausal>
  __host__ __device__ QueryBlock at(unsigned index) const {
    const unsigned group_blocks = heads_per_group * m_blocks;
    const unsigned group = index / group_blocks, within = index % group_blocks;
    const unsigned first_pair = group * heads_per_group;
    const unsigned group_pairs = pairs - first_pair < heads_per_group ? pairs - first_pair : heads_per_group;
    const unsigned rank = within / group_pairs, pair = first_pair + within % group_pairs;
    return {pair / heads_q, pair % heads_q, IsCausal ? m_blocks - 1 - rank : rank};
  }

  int64_t blocks() const { return int64_t(m_blocks) * pairs; }
};

// The order for a launch of block_m-row query blocks. Causal calls group as
// many heads as keep their K and V within half the L2 (GQA heads of one K/V
// head count once); other calls, whose blocks all take the same time, keep
// one head per group. Throws when the grid does not fit one launch.
inline QueryBlockOrder make_query_block_order(const AttentionShape& sh, int block_m, int element_bytes,
                                              bool is_causal) {
  const int64_t m_blocks = (sh.seqlen_q + block_m - 1) / block_m;
  const int64_t pairs = sh.batch * sh.heads_q;
  if (m_blocks * pairs > 2147483647)
    throw std::runtime_error("fusedattn: B x Hq x query blocks exceeds one launch (2^31 - 1)");
  int64_t heads_per_group = 1;
  if (is_causal && pairs > 1) {
    int device = 0, l2_bytes = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) == cudaSuccess) {
      const int64_t kv_bytes_per_head = 2 * sh.seqlen_k * sh.head_dim * element_bytes;
      if (kv_bytes_per_head > 0)
        heads_per_group = int64_t(l2_bytes) / 2 * sh.group_size() / kv_bytes_per_head;
    }
    heads_per_group = std::clamp<int64_t>(heads_per_group, 1, pairs);
  }
  return {static_cast<unsigned>(m_blocks), static_cast<unsigned>(sh.heads_q), static_cast<unsigned>(pairs),
          static_cast<unsigned>(heads_per_group)};
}

}  // namespace fusedattn::cuda
