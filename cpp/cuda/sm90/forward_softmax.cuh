// The sm90 forward's softmax of one score tile, per consumer thread (each
// warp's accumulators have mma.sync's C layout, so common/online_softmax.cuh
// applies): hide the keys past the item's end and (banded) outside the band
// (common/band.cuh), add attn_mask, take the online-softmax step.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/mask.cuh"
#include "../common/online_softmax.cuh"
#include "forward_scheduler.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Sides: the band's sides the kernel tests; Mask: attn_mask's kind; Capped:
// soft-capping on (SoftCap); all fixed at compile time (a run-time choice of
// the mask or the cap made the consumers spill).
template <int BlockN, typename T, BandSides Sides, MaskKind Mask, bool Capped>
struct Sm90ForwardSoftmax {
  static constexpr int kNTiles = BlockN / 8;
  static constexpr bool kBanded = Sides != BandSides::kNone, kLeftSide = Sides == BandSides::kBoth;
  const ForwardParams& p;
  SoftCap cap;  // its scale_log2 takes a raw (or, Capped, capped) score to base-2 units
  int warp_row, g, t;  // this warp's first row in its warpgroup's 64; the thread's MMA row and column groups
  int seqlen_q;

  // Hides the entries of columns c (from this thread's first, 0) past
  // last[h] or, Left, before first[h] of row h.
  template <bool Left = true>
  __device__ __forceinline__ static void hide_outside(float (&s)[kNTiles][4], const int (&first)[2],
                                                      const int (&last)[2]) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + (e & 1);
        if (c > last[e >> 1] || (Left && c < first[e >> 1])) s[nt][e] = -INFINITY;
      }
  }

  // attn_mask (base-2 units) added to the visible scores of the tile at col0
  // of rows from wg_row0: a hidden entry stays -inf whatever the mask holds
  // there, and rows past the queries read none of it.
  __device__ __forceinline__ void add_mask(float (&s)[kNTiles][4], const Sm90ForwardItem& it, int wg_row0,
                                           int col0) const {
    const int64_t mask_base = it.batch * p.mask.batch_stride + it.head * p.mask.head_stride;
    int64_t row_offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      row_offset[h] = mask_base + int64_t(wg_row0 + warp_row + g + 8 * h) * p.mask.row_stride +
                      int64_t(col0 + 2 * t) * p.mask.col_stride;
    const bool row_valid[2] = {wg_row0 + warp_row + g < seqlen_q, wg_row0 + warp_row + g + 8 < seqlen_q};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (row_valid[e >> 1] && s[nt][e] != -INFINITY)
          s[nt][e] += mask_entry<Mask, T>(p.mask.ptr, row_offset[e >> 1] + (nt * 8 + (e & 1)) * p.mask.col_stride);
  }

  // The tile of `entry` (tile_entry's) of the rows from wg_row0; `rescale`
  // gets the factor by which O must be rescaled. The scores stay raw until
  // the exponent, which takes the scale (>= FLT_MIN: the planner checks) in
  // one FFMA; a tile whose entry says it reads attn_mask, which adds base-2
  // values, scales its scores first and passes the exponent a factor of 1.
  // Capped, the scores become tanh(S scale / cap) first, before anything is
  // hidden (tanh of -inf would be -1), and the exponent's factor is cap log2 e.
  __device__ __forceinline__ void step(float (&s)[kNTiles][4], float (&m_i)[2], float (&l_i)[2], float (&rescale)[2],
                                       const Sm90ForwardItem& it, int wg_row0, int entry) const {
    if constexpr (Capped) cap.apply(s);
    const int col0 = MaskTiles::tile_of(entry) * BlockN;
    // The band's left side cuts only a window's tiles: causal calls test
    // their diagonal tiles on the right alone.
    const bool cuts_left = kLeftSide && it.band.cuts_left(wg_row0, 64, col0);
    if (cuts_left || col0 + BlockN > it.key_end || (kBanded && it.band.cuts_right(wg_row0, col0, BlockN))) {
      // Row h of this thread sees tile columns [first[h], last[h]]: the keys
      // before the end and (banded) inside the band. Subtracting the
      // thread's column 2t once leaves compile-time offsets in the loop.
      int first[2], last[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wg_row0 + warp_row + g + 8 * h;
        last[h] = it.key_end - col0 - 1;
        first[h] = 0;
        if (kBanded) last[h] = min(last[h], row + it.band.upper - col0);
        if (kLeftSide) first[h] = row + it.band.lower - col0;
        last[h] -= 2 * t;
        first[h] -= 2 * t;
      }
      if (cuts_left)
        hide_outside(s, first, last);
      else
        hide_outside<false>(s, first, last);
    }
    bool reads_mask = false;
    if constexpr (Mask != MaskKind::None) {
      reads_mask = MaskTiles::reads_mask(entry);
      if (reads_mask) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] *= cap.scale_log2;
        add_mask(s, it, wg_row0, col0);
      }
    }
    online_softmax_scores</*RawScores=*/true>(s, m_i, l_i, rescale, reads_mask ? 1.0f : cap.scale_log2);
  }
};

}  // namespace fusedattn::cuda
