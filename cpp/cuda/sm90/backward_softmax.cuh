// The sm90 backward's softmax step, per consumer thread: from a step's S^T
// and dP^T (this warpgroup's 64 keys by the step's queries) to
//   P^T  = 2^(S^T scale log2 e - lse log2 e),  dS^T = P^T (dP^T - delta)
// (soft-capped: P^T = 2^(tanh(S^T scale / cap) cap log2 e - lse log2 e), and
// dS^T takes tanh's slope as a factor) with every hidden entry 0 in both:
// past the keys or the queries, outside the band, or hidden by attn_mask (read
// on the steps the mask's lists mark, each warp copying its entries to shared
// memory first).
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/mask.cuh"
#include "../common/online_softmax.cuh"
#include "backward_traits.h"

namespace fusedattn::cuda {

// Capped: soft-capping on (SoftCap), fixed at compile time as in the forward.
template <typename Tr, typename T, bool Banded, MaskKind Mask, bool Capped>
struct Sm90BackwardSoftmax {
  static constexpr int kBlockM = Tr::kBlockM, kMTiles = kBlockM / 8;
  static constexpr bool kListed = Mask != MaskKind::None;
  using MaskEntry = MaskStorage<Mask, T>;
  // Rounds of staging a step's mask entries (16 keys by kBlockM queries) take.
  static constexpr int kMaskRounds =
      (16 * kBlockM * int(sizeof(MaskEntry)) + Tr::kMaskStageBytes - 1) / Tr::kMaskStageBytes;
  static_assert(kMTiles % kMaskRounds == 0);
  static constexpr int kRoundTiles = kMTiles / kMaskRounds, kRoundRows = 8 * kRoundTiles;
  static_assert(16 * kRoundRows * int(sizeof(MaskEntry)) <= Tr::kMaskStageBytes, "a round fits the stage");
  static_assert(4 * kMTiles <= 64, "a bit per element");

  const ForwardParams& f;
  unsigned batch;  // the walk's batch item
  MaskEntry* mask_stage;  // this warp's
  // This warpgroup's 64 keys from my_key0; this warp's 16 from warp_row of
  // those (accumulator rows g, g + 8 of them).
  int my_key0;
  int warp_row;
  // The sequence's lengths (the call's, dense); banded: query i sees key j
  // iff band.sees(i, j). In 32 bits (the planner holds lengths to kBand32MaxLength).
  int seqlen_q, seqlen_k;
  Band32 band;
  SoftCap cap;  // its scale_log2 takes a raw (or, Capped, capped) score to base-2 units
  int lane, g, t;

  // Element (nt, e) (key row g + 8 (e / 2), query column nt * 8 + 2t + e % 2):
  // past the keys or queries, or outside the band. Bitwise, not
  // short-circuit: each || can become a branch.
  __device__ __forceinline__ bool outside(int m0, int nt, int e) const {
    const int key = my_key0 + warp_row + g + (e >> 1) * 8, query = m0 + nt * 8 + 2 * t + (e & 1);
    bool out = (key >= seqlen_k) | (query >= seqlen_q);
    if constexpr (Banded) out |= !band.sees(query, key);
    return out;
  }

  // P^T in place of st and dS^T in place of dpt, for the step at query m0 of
  // head `head`; lse and delta are the step's rows (natural log). The
  // kernel may run the pieces apart (hidden_entries and probabilities while
  // dP^T is still on the tensor cores, then score_gradients): this is them
  // in order.
  __device__ __forceinline__ void operator()(float (&st)[kMTiles][4], float (&dpt)[kMTiles][4], int64_t head,
                                             int m0, bool reads_mask, const float* lse,
                                             const float* delta) const {
    // Capped, S^T becomes tanh(S^T scale / cap) first and dP^T - delta takes
    // tanh's slope there, so that nothing below needs the raw score again.
    if constexpr (Capped) {
      cap.apply(st);
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dpt[nt][e] = (dpt[nt][e] - delta[nt * 8 + 2 * t + (e & 1)]) * SoftCap::slope(st[nt][e]);
    }
    const Hidden hidden = hidden_entries(st, head, m0, reads_mask);
    probabilities(st, hidden, lse);
    score_gradients(st, dpt, hidden, delta);
  }

  // A step's hidden entries: past the keys or the queries (where lse and
  // delta are the next head's, and a NaN there must not reach dK), outside
  // the band, or hidden by attn_mask (whose row's lse may be -inf), as bit
  // 4 nt + e, on the steps that can have any (none elsewhere). Under
  // attn_mask it turns S^T into base-2 scores with the mask added (then
  // score_scale is 1).
  struct Hidden {
    uint64_t bits;
    float score_scale;  // S^T to base-2 scores
    bool any;           // the step can hide entries: bits is to be applied
  };
  __device__ __forceinline__ Hidden hidden_entries(float (&st)[kMTiles][4], int64_t head, int m0,
                                                   bool reads_mask) const {
    Hidden hidden{0, cap.scale_log2,
                  reads_mask || my_key0 + 64 > seqlen_k || m0 + kBlockM > seqlen_q ||
                      (Banded && band.cuts(m0, kBlockM, my_key0, 64))};
    if (!hidden.any) return hidden;
    if constexpr (kListed) {
      const int64_t mask_base = batch * f.mask.batch_stride + head * f.mask.head_stride;
#pragma unroll
      for (int round = 0; round < kMaskRounds; ++round) {
        if (reads_mask) stage_mask_round(mask_base, m0 + round * kRoundRows);
#pragma unroll
        for (int j = 0; j < kRoundTiles; ++j) {
          const int nt = round * kRoundTiles + j;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key_row = g + (e >> 1) * 8, query_col = nt * 8 + 2 * t + (e & 1);
            bool is_outside = outside(m0, nt, e);
            float added = 0.0f;
            if (reads_mask && !is_outside)
              added = mask_entry<Mask, T>(mask_stage, (query_col - round * kRoundRows) * 16 + key_row);
            is_outside |= added == -INFINITY;
            st[nt][e] = st[nt][e] * cap.scale_log2 + added;
            hidden.bits |= uint64_t(is_outside) << (4 * nt + e);
          }
        }
      }
      hidden.score_scale = 1.0f;
    } else {
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) hidden.bits |= uint64_t(outside(m0, nt, e)) << (4 * nt + e);
    }
    return hidden;
  }

  // P^T in place of st. Every entry is computed, hidden ones too (they may be
  // NaN): score_gradients zeroes them after. The exponentials are one
  // straight run with no test per element; a test per element there became
  // predication or a branch per element, which serialised them and cost
  // instructions on every step (docs/cuda-notes.md, rungs 4 and 6).
  __device__ __forceinline__ void probabilities(float (&st)[kMTiles][4], const Hidden& hidden,
                                                const float* lse) const {
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        st[nt][e] = exp2f(st[nt][e] * hidden.score_scale - lse_in_log2(lse[nt * 8 + 2 * t + (e & 1)]));
  }

  // dS^T = P^T (dP^T - delta) in place of dpt (capped: dpt already holds
  // (dP^T - delta) tanh's slope), then the hidden entries 0 in both.
  __device__ __forceinline__ void score_gradients(float (&st)[kMTiles][4], float (&dpt)[kMTiles][4],
                                                  const Hidden& hidden, const float* delta) const {
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dpt[nt][e] = st[nt][e] * (Capped ? dpt[nt][e] : dpt[nt][e] - delta[nt * 8 + 2 * t + (e & 1)]);
    if (!hidden.any) return;
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if ((hidden.bits >> (4 * nt + e)) & 1u) st[nt][e] = dpt[nt][e] = 0.0f;
  }

  // The mask entries of this warp's 16 keys by a round's kRoundRows queries
  // from query0 to the warp's stage: entry (query r, key j) at r * 16 + j,
  // 16 lanes per query row, loaded kBatch at a time before any is stored.
  __device__ __forceinline__ void stage_mask_round(int64_t mask_base, int64_t query0) const {
    constexpr int kPerLane = kRoundRows * 16 / 32, kBatch = 8;
    static_assert(kPerLane % kBatch == 0);
    __syncwarp();  // the last round's reads are done
#pragma unroll
    for (int b0 = 0; b0 < kPerLane; b0 += kBatch) {
      MaskEntry staged[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = (b0 + u) * 32 + lane;
        const int64_t query = query0 + i / 16, key = my_key0 + warp_row + i % 16;
        staged[u] = query < seqlen_q && key < seqlen_k
                        ? static_cast<const MaskEntry*>(f.mask.ptr)[mask_base + query * f.mask.row_stride +
                                                                    key * f.mask.col_stride]
                        : MaskEntry{};
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) mask_stage[(b0 + u) * 32 + lane] = staged[u];
    }
    __syncwarp();
  }
};

}  // namespace fusedattn::cuda
