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

// One warp's keys of a paged cache (KVCacheParams::block_table), tile by
// tile: next() answers where the warp's first key of the tile being loaded
// lies, and reads the next tile's table entry ahead, so the load of a tile
// never waits for its entry. Keys at or past the sequence's length read no
// entry (page 0 stands in; their rows load as zeros). Only the key and the
// entry read ahead live in registers; the rest is read from the kernel's
// parameters. PageCursor<false>, for a contiguous cache, holds nothing and
// never meets a bad entry, so an unpaged kernel pays for no paging.
template <bool Paged>
struct PageCursor {
  static constexpr bool bad = false;
  __device__ PageCursor(const KVCacheParams&, int64_t, int64_t, int64_t, int64_t) {}
};

template <>
struct PageCursor<true> {
  struct Rows {
    int64_t page, row;  // the cache's first index and the row there
  };
  const KVCacheParams& p;
  int64_t batch, offset, length;  // the warp's keys are offset, offset + 1, ... of each tile
  int64_t key = 0;                // the key whose entry was read ahead
  int32_t entry = 0;
  bool bad = false;  // an entry outside [0, pages) was met

  __device__ PageCursor(const KVCacheParams& params, int64_t b, int64_t warp_offset, int64_t sequence_length,
                        int64_t first_tile_key)
      : p(params), batch(b), offset(warp_offset), length(sequence_length) {
    read_ahead(first_tile_key);
  }
  // The warp's rows of the tile loaded now; then the entry of the tile that
  // starts at next_tile_key (pass the length where none follows).
  __device__ Rows next(int64_t next_tile_key) {
    const int64_t page = entry, row = key % p.page_size;
    read_ahead(next_tile_key);
    const bool valid = page >= 0 && page < p.pages;
    bad |= !valid;
    return {valid ? page : 0, row};
  }

 private:
  __device__ void read_ahead(int64_t tile_key) {
    key = tile_key + offset;
    entry = key < length ? __ldg(p.block_table + batch * p.max_blocks + key / p.page_size) : 0;
  }
};

// Where row `row` of [B, Hq, Nq] starts in p.attn.out.
__device__ __forceinline__ int64_t output_offset(const ForwardParams& a, int64_t row) {
  const AttentionShape& sh = a.shape;
  const int64_t batch = row / (sh.heads_q * sh.seqlen_q);
  const int64_t head = row / sh.seqlen_q % sh.heads_q, query = row % sh.seqlen_q;
  return batch * a.out_strides.batch + head * a.out_strides.head + query * a.out_strides.row;
}

}  // namespace fusedattn::cuda
