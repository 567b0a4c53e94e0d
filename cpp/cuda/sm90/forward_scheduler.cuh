// The sm90 forward's tile scheduler. A work item is a query block of one
// head, in the launch's BlockOrder (common/block_order.h: longest first under
// a band, heads grouped for L2) or, packed, the planner's longest-first work
// list (common/sequences.cuh), and the key tiles its band reaches
// (common/band.cuh), or under attn_mask those its row of the mask's tile
// lists holds (common/mask_tiles.h). A block takes the item of its own index
// first; persistent blocks (tile_size.h) then take items from the work
// counter until none are left.
#pragma once

#include "../common/band.cuh"
#include "../common/block_order.h"
#include "../common/sequences.cuh"
#include "../hopper/warpgroup.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Rows [row0, row0 + rows) of query head `head` of a sequence of seqlen_q
// queries and seqlen_k keys, which see keys [key_begin, key_end) in n_tiles
// tiles: those from tile0, or those of the mask's list at mask_list (an
// offset into p.mask.tiles.lists: 32 bits leave the consumers a register).
// Rows and keys count from the sequence's first, which is row q0 (k0) of
// batch `batch`'s heads: 0 in a dense call.
struct Sm90ForwardItem {
  int batch = 0, head = 0, head_kv = 0, row0 = 0, rows = 0, key_begin = 0, key_end = 0, tile0 = 0, n_tiles = 0;
  Band32 band;  // banded: this sequence's
  int mask_list = 0;
  int q0 = 0, k0 = 0, seqlen_q = 0, seqlen_k = 0;
};

// The item's tile j as a mask list's entry (MaskTiles::entry).
template <bool HasMask>
__device__ __forceinline__ int tile_entry(const ForwardParams& p, const Sm90ForwardItem& it, int j) {
  if constexpr (HasMask) return __ldg(p.mask.tiles.lists + it.mask_list + j);
  return MaskTiles::entry(it.tile0 + j, false);
}

template <int BlockM, int BlockN, bool Banded, bool HasMask>
struct Sm90ForwardScheduler {
  const BlockOrder& order;
  const ForwardParams& p;
  unsigned n_items, heads_q;
  // Lengths fit in int here (the planner checks): 32-bit row arithmetic
  // leaves the consumers more of their registers.
  int group, seqlen_q;

  __device__ __forceinline__ Sm90ForwardScheduler(const BlockOrder& order, const ForwardParams& p)
      : order(order),
        p(p),
        n_items(static_cast<unsigned>(p.varlen.on() ? p.varlen.query_items * p.shape.heads_q : order.blocks())),
        heads_q(static_cast<unsigned>(p.shape.heads_q)),
        group(static_cast<int>(p.shape.heads_q / p.shape.heads_kv)),
        seqlen_q(static_cast<int>(p.shape.seqlen_q)) {}

  __device__ __forceinline__ unsigned first() const { return blockIdx.x; }
  // The item after this block's last one: a grid smaller than the items
  // takes the rest from the counter (zeroed at launch).
  __device__ __forceinline__ unsigned next(unsigned* work_counter) const {
    return gridDim.x < n_items ? warp_uniform(gridDim.x + atomicAdd(work_counter, 1u), 1u) : n_items;
  }
  __device__ __forceinline__ bool done(unsigned index) const { return index >= n_items; }

  __device__ __forceinline__ Sm90ForwardItem item(unsigned index) const {
    const bool packed = !HasMask && p.varlen.on();  // packed calls take no attn_mask
    const GridBlock block = packed ? work_item(p.varlen.query_tiles, index, heads_q) : order.at<Banded>(index);
    const SequenceRows seq = SequenceRows::of(p, block.pair / heads_q, packed);
    Sm90ForwardItem it;
    it.batch = static_cast<int>(seq.batch);
    it.q0 = static_cast<int>(seq.q0);
    it.k0 = static_cast<int>(seq.k0);
    it.seqlen_q = static_cast<int>(seq.seqlen_q);
    it.seqlen_k = static_cast<int>(seq.seqlen_k);
    it.head = static_cast<int>(block.pair % heads_q);
    it.head_kv = it.head / group;
    it.row0 = static_cast<int>(block.block) * BlockM;
    it.rows = min(BlockM, it.seqlen_q - it.row0);
    if constexpr (Banded) {
      it.band = Band32::of(p, it.seqlen_q, it.seqlen_k);
      it.key_begin = it.band.key_begin(it.row0, it.seqlen_k);
      it.key_end = it.band.key_end(it.row0 + it.rows - 1, it.seqlen_k);
    } else {
      it.key_end = it.seqlen_k;
    }
    it.tile0 = it.key_begin / BlockN;
    it.n_tiles = it.key_end > it.key_begin ? (it.key_end + BlockN - 1) / BlockN - it.tile0 : 0;
    if constexpr (HasMask) {
      // The lists hold the band's tiles the mask leaves visible.
      const MaskTiles& tiles = p.mask.tiles;
      const int64_t row = tiles.row(it.batch, it.head, block.block);
      it.mask_list = static_cast<int>(row * tiles.capacity);
      it.n_tiles = it.n_tiles > 0 ? __ldg(tiles.counts + row) : 0;
    }
    return it;
  }
};

}  // namespace fusedattn::cuda
