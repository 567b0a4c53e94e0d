// The key-block kernels' tile scheduler (sm80's and sm90's backwards): the
// launch's grid (one block per key block of each (sequence, kv head, head
// split), in make_key_block_order's order or, packed, the planner's list
// of key tiles) and each block's walk over the query blocks that see its
// keys; the deterministic mode's turns.
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

// Deterministic mode under a band: where a pair's key blocks all fit on the
// GPU at once (rotation_blocks, dq_rotation_blocks' bound), the pairs go one
// at a time, each from key block 0, the longest walk (as the default's order
// does within a group of pairs), instead of from its last: the short walks
// then fill the launch's tail, not the long ones. The turns stay the last
// key block's first, so a block may wait on blocks launched after it (of its
// pair, which fits); in step none waits, since block j + 1 reaches a query
// tile before block j does. 0 (the default mode): never.
__host__ __device__ inline bool longest_first_ordered(const BlockOrder& order, int rotation_blocks) {
  return order.blocks_per_pair <= unsigned(rotation_blocks > 0 ? rotation_blocks : 0);
}

inline KeyBlockGrid key_block_grid(const BackwardParams& p, int block_n, int element_bytes, bool banded,
                                   int rotation_blocks = 0) {
  BlockOrder order = make_key_block_order(p.fwd.shape, block_n, p.head_splits, element_bytes, banded);
  if (banded && longest_first_ordered(order, rotation_blocks)) order.pairs_per_group = 1;
  return {order, grid_blocks(order, p.fwd.varlen.on(), p.fwd.varlen.key_items, p.fwd.shape.heads_kv)};
}

// The query blocks of block_m queries that key block [key0, key0 + keys)
// visits: `count` of them from the one at m_begin (none when no query sees
// its keys); every one unbanded. A block visits a query block iff one of its
// queries sees one of the keys (the band's queries of a key, and keys of a
// query, are intervals whose ends grow with it).
struct VisitedQueryBlocks {
  int64_t m_begin, count;
};
template <bool Banded>
__host__ __device__ inline VisitedQueryBlocks visited_query_blocks(const Band& band, int64_t key0, int64_t keys,
                                                                   int block_m) {
  const int64_t first = Banded ? band.query_begin(key0) : 0;
  const int64_t end = Banded ? band.query_end(key0 + keys - 1) : band.seqlen_q;
  const int64_t m_begin = first / block_m * block_m;
  return {m_begin, first < end ? (end - m_begin + block_m - 1) / block_m : 0};
}

// The last key block of block_n keys that visits query block [m0, m0 +
// block_m), one that some key block visits (the rule above, from the query
// side: its queries see keys up to key_end(its last query)).
template <bool Banded>
__host__ __device__ inline int64_t last_visiting_key_block(const Band& band, int64_t m0, int block_m, int block_n) {
  const int64_t last_query = (m0 + block_m < band.seqlen_q ? m0 + block_m : band.seqlen_q) - 1;
  const int64_t keys_end = Banded ? band.key_end(last_query) : band.seqlen_k;
  return (keys_end - 1) / block_n;
}

// Deterministic mode's turn counters: [B x Hq][tiles per head][shares]
// ints. Packed, sequence b's tiles start at tile q0 / BlockM + b, which keeps
// the sequences apart (their first rows need not start a tile).
__host__ __device__ inline int64_t dq_turn_tiles_per_head(const ForwardParams& f, int block_m) {
  return (f.shape.seqlen_q + block_m - 1) / block_m + (f.varlen.on() ? f.varlen.batch : 0);
}
inline int64_t dq_turn_counters(const ForwardParams& f, int block_m, int shares) {
  return f.shape.batch * f.shape.heads_q * dq_turn_tiles_per_head(f, block_m) * shares;
}
// Query tile m0 of a sequence (packed: sequence `sequence`, whose queries
// start at row q0) among its head's tiles.
__host__ __device__ inline int64_t dq_turn_tile(const ForwardParams& f, int64_t sequence, int64_t q0, int64_t m0,
                                                int block_m) {
  return (f.varlen.on() ? q0 / block_m + sequence : 0) + m0 / block_m;
}

// Deterministic mode without a band: every key block of a sequence visits
// every step of the walk (query head x query tile); walking in the same order
// they would all meet at a tile at once and add there one after another, each
// a hand-over behind the one before. So, where a sequence has at most
// `max_blocks` key blocks, block j of `blocks` starts its walk of `steps`
// steps at step j * (steps / blocks), wrapping: in step, each visits a tile of
// its own. A step's turns are then the order in which the blocks reach it,
// the one that started at or before it nearest to it first. A block so may
// wait on blocks launched after it: all of the sequence's key blocks must fit
// on the GPU at once, hence `max_blocks` (dq_rotation_blocks). Longer
// sequences, and walks with fewer steps than blocks, start every block at step
// 0 and take turns from the last block down, each waiting only on blocks
// launched before it. The dense grid launches a sequence's (a pair's) key
// blocks together; a packed call's list does not, and is never rotated. The
// bound depends on the SM count, so the order of the adds, and the bits, are
// the same on every run of one GPU model, not across models.
__host__ __device__ inline int rotated_step(int s, int start, int steps) {  // s, start < steps
  return s < steps - start ? s + start : s - (steps - start);
}

struct DqRotation {
  int blocks;   // the sequence's key blocks
  int j;        // this block's
  int spacing;  // steps between two starts (0: none rotated)

  __host__ __device__ static DqRotation of(int n_block, int blocks, int steps, int max_blocks) {
    return {blocks, n_block, blocks <= max_blocks ? steps / blocks : 0};
  }
  __host__ __device__ int start() const { return spacing * j; }
  // The walk's step visited at the block's step s (< steps).
  __host__ __device__ int step(int s, int steps) const { return rotated_step(s, start(), steps); }
  // The block's turn at step `step` of the walk (counted from step 0, not
  // from its start).
  __host__ __device__ int turn(int step) const {
    if (spacing == 0) return blocks - 1 - j;
    const int nearest = step / spacing < blocks - 1 ? step / spacing : blocks - 1;
    return (nearest - j + blocks) % blocks;
  }
};

// The most key blocks a sequence's walks are rotated over: all of them wait
// on one another, so a quarter of the SMs (at one block each) must hold them
// while other kernels (a collective's, say) run beside this one; at most 32.
inline int dq_rotation_blocks(int sm_count) { return sm_count / 4 > 32 ? 32 : sm_count / 4; }

// What a block of a key-block kernel owns and walks (the sm90 kernel's; the
// sm80 kernel computes the same inline, where this struct cost it a spill at
// d=64 on sm_90a). The grid's order is make_key_block_order's: pairs of
// (sequence, kv head, head split), key block 0 (the most queries see it)
// first under causal, and every pair's last key block first in deterministic
// mode (below); packed (not Listed), the key tiles' work list, one
// split, and rows and keys count from the sequence's first (`seq`). A block
// walks every query block of every query head
// of its share of the group that can see one of its keys: banded, the
// queries from band.query_begin(key0) to band.query_end(last key); Listed
// (attn_mask sorted by key tiles, common/mask_tiles.h), the query blocks of
// each head's list.
//
// Deterministic mode (the sm90 kernel's instantiation for it, LastFirst): the key blocks that
// visit a query tile add their dQ shares into it one at a time, each at its
// turn (hopper/turns.cuh) in a counter of its own per (query head, query
// tile, share). Under a band, from the last key block down: the later key
// blocks reach a tile first (FA3's order for causal), so the turns seldom make
// one wait; a block waits only on blocks launched before it (each pair's key
// blocks go last first, and the planner lists a packed call's key tiles so),
// or, where a pair's blocks fit at once, on its pair's (longest_first_ordered).
// Without one, the walks are rotated (DqRotation). That no wait can hang
// rests on the hardware starting blocks in the order of their index, which
// CUDA does not promise but does (FA3 rests on it too).
template <int BlockN, int BlockM, bool Banded, bool Listed = false, bool LastFirst = false>
struct KeyBlockWalk {
  unsigned batch, head_kv, n_block;
  unsigned sequence;               // the sequence's index (dense: its batch)
  SequenceRows seq;                // the block's sequence
  int64_t key0, keys;              // the block's keys: [key0, key0 + keys) of the sequence
  int64_t first_head, m_begin;     // the walk starts at this query head and query
  int steps_per_head, steps;       // query blocks per head (Listed: of the first head), and in all (< 2^31)
  int start = 0;                   // Rotated: the step the walk starts at (DqRotation)
  const MaskTiles& tiles;
  static constexpr bool Rotated = LastFirst && !Banded && !Listed;

  // Step s: its query head, first query, and whether it reads attn_mask.
  struct Step {
    int64_t head, m0;
    bool reads_mask;
  };

  // rotation_blocks: deterministic mode's bound (dq_rotation_blocks): for
  // Rotated walks and longest_first_ordered.
  __device__ KeyBlockWalk(const BackwardParams& p, const BlockOrder& order, int rotation_blocks = 0)
      : tiles(p.fwd.mask.tiles) {
    const AttentionShape& sh = p.fwd.shape;
    const bool packed = !Listed && p.fwd.varlen.on();  // packed calls take no attn_mask
    const unsigned heads_kv = static_cast<unsigned>(sh.heads_kv);
    const GridBlock block = packed ? work_item(p.fwd.varlen.key_tiles, blockIdx.x, heads_kv)
                            : LastFirst && !(Banded && longest_first_ordered(order, rotation_blocks))
                                ? order.at<true>(blockIdx.x)
                                : order.at<false>(blockIdx.x);
    n_block = block.block;
    const unsigned head_split = block.pair % static_cast<unsigned>(p.head_splits);
    const unsigned bh = block.pair / static_cast<unsigned>(p.head_splits);
    sequence = bh / heads_kv;
    seq = SequenceRows::of(p.fwd, sequence, packed);
    batch = static_cast<unsigned>(seq.batch);
    head_kv = bh % heads_kv;
    const int64_t group = sh.heads_q / sh.heads_kv;
    const int64_t split_heads = group / p.head_splits;
    first_head = head_kv * group + head_split * split_heads;
    key0 = int64_t(n_block) * BlockN;
    keys = min(int64_t(BlockN), seq.seqlen_k - key0);
    const VisitedQueryBlocks visited =
        visited_query_blocks<Banded>(Band::of(p.fwd, seq.seqlen_q, seq.seqlen_k), key0, keys, BlockM);
    m_begin = visited.m_begin;
    steps_per_head = static_cast<int>(visited.count);
    steps = steps_per_head * static_cast<int>(split_heads);
    if constexpr (Rotated) start = rotation(rotation_blocks).start();
    if constexpr (Listed) {
      steps_per_head = count(0);  // every head's where the mask is the same for the heads
      steps = steps_per_head * static_cast<int>(split_heads);
      if (tiles.head_stride != 0)
        for (int i = 1; i < split_heads; ++i) steps += count(i) - steps_per_head;
    }
  }
  // Rotated: the block's rotation (recomputed where needed: the walk is
  // live in the producer's few registers).
  __device__ DqRotation rotation(int rotation_blocks) const {
    return DqRotation::of(static_cast<int>(n_block), static_cast<int>((seq.seqlen_k + BlockN - 1) / BlockN), steps,
                          rotation_blocks);
  }
  // Deterministic mode: this block's turn at query tile m0 of query head
  // `head` (which it visits): banded, how many key blocks after it visit the
  // tile too; else DqRotation's (rotation_blocks as the walk was given).
  __device__ int dq_turn(const ForwardParams& f, int64_t head, int64_t m0, int rotation_blocks) const {
    static_assert(!Listed, "a walk over attn_mask's lists has no turns");
    if constexpr (Rotated) {
      return rotation(rotation_blocks).turn(static_cast<int>((head - first_head) * steps_per_head + (m0 - m_begin) / BlockM));
    } else {
      const Band band = Band::of(f, seq.seqlen_q, seq.seqlen_k);
      return static_cast<int>(last_visiting_key_block<Banded>(band, m0, BlockM, BlockN) - n_block);
    }
  }
  // The turn counter of share `share` (of `shares`) at query tile m0 of query
  // head `head`, in dq_turn_counters' layout.
  __device__ int64_t dq_turn_counter(const ForwardParams& f, int64_t head, int64_t m0, int share,
                                     int shares) const {
    const int64_t tile = (batch * f.shape.heads_q + head) * dq_turn_tiles_per_head(f, BlockM) +
                         dq_turn_tile(f, sequence, seq.q0, m0, BlockM);
    return tile * shares + share;
  }

  __device__ int64_t list_row(int i) const { return tiles.row(batch, first_head + i, n_block); }
  __device__ int count(int i) const { return tiles.counts[list_row(i)]; }

  __device__ Step at(int s) const {
    if constexpr (!Listed) {
      if constexpr (Rotated) {
        s = rotated_step(s, start, steps);
      }
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
