// The key-block kernels' tile scheduler (sm80's and sm90's backwards): the
// launch's grid (one block per key block of each (sequence, kv head, head
// split), in make_key_block_order's order or, packed, the planner's
// longest-first key tiles) and each block's walk over the query blocks
// that see its keys.
#pragma once

#include <cstdint>

#include "band.cuh"
#include "block_order.h"
#include "mask_tiles.h"
#include "sequences.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// A key-block kernel's launch: its order and how many blocks it takes.
struct KeyBlockGrid {
  BlockOrder order;
  unsigned blocks;
};

inline KeyBlockGrid key_block_grid(const BackwardParams& p, int block_n, int element_bytes, bool banded) {
  const BlockOrder order = make_key_block_order(p.fwd.shape, block_n, p.head_splits, element_bytes, banded);
  return {order, grid_blocks(order, p.fwd.varlen.on(), p.fwd.varlen.key_items, p.fwd.shape.heads_kv)};
}

// What a block of a key-block kernel owns and walks (the sm90 kernel's; the
// sm80 kernel computes the same inline, where this struct cost it a spill at
// d=64 on sm_90a). The grid's order is make_key_block_order's: pairs of
// (sequence, kv head, head split), key block 0 (the most queries see it)
// first under causal; packed (not Listed), the key tiles' work list, one
// split, and rows and keys count from the sequence's first (`seq`). A block
// walks every query block of every query head
// of its share of the group that can see one of its keys: banded, the
// queries from band.query_begin(key0) to band.query_end(last key); Listed
// (attn_mask sorted by key tiles, common/mask_tiles.h), the query blocks of
// each head's list.
template <int BlockN, int BlockM, bool Banded, bool Listed = false>
struct KeyBlockWalk {
  unsigned batch, head_kv, n_block;
  SequenceRows seq;                // the block's sequence
  int64_t key0, keys;              // the block's keys: [key0, key0 + keys) of the sequence
  int64_t first_head, m_begin;     // the walk starts at this query head and query
  int steps_per_head, steps;       // query blocks per head (Listed: of the first head), and in all (< 2^31)
  const MaskTiles& tiles;

  // Step s: its query head, first query, and whether it reads attn_mask.
  struct Step {
    int64_t head, m0;
    bool reads_mask;
  };

  __device__ KeyBlockWalk(const BackwardParams& p, const BlockOrder& order) : tiles(p.fwd.mask.tiles) {
    const AttentionShape& sh = p.fwd.shape;
    const bool packed = !Listed && p.fwd.varlen.on();  // packed calls take no attn_mask
    const unsigned heads_kv = static_cast<unsigned>(sh.heads_kv);
    const GridBlock block =
        packed ? work_item(p.fwd.varlen.key_tiles, blockIdx.x, heads_kv) : order.at<false>(blockIdx.x);
    n_block = block.block;
    const unsigned head_split = block.pair % static_cast<unsigned>(p.head_splits);
    const unsigned bh = block.pair / static_cast<unsigned>(p.head_splits);
    seq = SequenceRows::of(p.fwd, bh / heads_kv, packed);
    batch = static_cast<unsigned>(seq.batch);
    head_kv = bh % heads_kv;
    const int64_t group = sh.heads_q / sh.heads_kv;
    const int64_t split_heads = group / p.head_splits;
    first_head = head_kv * group + head_split * split_heads;
    key0 = int64_t(n_block) * BlockN;
    keys = min(int64_t(BlockN), seq.seqlen_k - key0);
    const Band band = Band::of(p.fwd, seq.seqlen_q, seq.seqlen_k);
    const int64_t first_query = Banded ? band.query_begin(key0) : 0;
    const int64_t query_end = Banded ? band.query_end(key0 + keys - 1) : seq.seqlen_q;
    m_begin = first_query / BlockM * BlockM;
    steps_per_head = static_cast<int>(first_query < query_end ? (query_end - m_begin + BlockM - 1) / BlockM : 0);
    steps = steps_per_head * static_cast<int>(split_heads);
    if constexpr (Listed) {
      steps_per_head = count(0);  // every head's where the mask is the same for the heads
      steps = steps_per_head * static_cast<int>(split_heads);
      if (tiles.head_stride != 0)
        for (int i = 1; i < split_heads; ++i) steps += count(i) - steps_per_head;
    }
  }
  __device__ int64_t list_row(int i) const { return tiles.row(batch, first_head + i, n_block); }
  __device__ int count(int i) const { return tiles.counts[list_row(i)]; }

  __device__ Step at(int s) const {
    if constexpr (!Listed) {
      return {first_head + s / steps_per_head, m_begin + int64_t(s % steps_per_head) * BlockM, false};
    } else {
      int i = 0;
      if (tiles.head_stride == 0) {
        i = s / steps_per_head;
        s %= steps_per_head;
      } else {
        for (int n; s >= (n = count(i)); ++i) s -= n;
      }
      const int32_t entry = tiles.list(list_row(i))[s];
      return {first_head + i, int64_t(MaskTiles::tile_of(entry)) * BlockM, MaskTiles::reads_mask(entry)};
    }
  }
};

}  // namespace fusedattn::cuda
