// The wide sm90 backward's softmax step, per consumer thread: from a step's S
// and dP (the step's queries by this consumer's keys) to
//   P = 2^(S scale log2 e - lse log2 e),  dS = P (dP - delta)
// with every hidden entry 0 in both: past the keys or the queries (where lse
// and delta are the next head's), or outside the band.
#pragma once

#include <cstdint>

#include "../common/band.cuh"
#include "../common/online_softmax.cuh"

namespace fusedattn::cuda {

template <int BlockM, int Keys, bool Banded>
struct Sm90WideBackwardSoftmax {
  static constexpr int kNTiles = Keys / 8;
  static_assert(4 * kNTiles <= 32, "a bit per element");
  // This consumer's keys from my_key0; this warp's 16 queries from warp_row of
  // the step's (accumulator rows g, g + 8 of them).
  int my_key0;
  int warp_row;
  // The sequence's lengths; banded: query i sees key j iff band.sees(i, j).
  // In 32 bits (the planner holds lengths to kBand32MaxLength).
  int seqlen_q, seqlen_k;
  Band32 band;
  float scale_log2;  // takes a raw score to base-2 units
  int g, t;

  // Element (nt, e): query row g + 8 (e / 2), key column nt * 8 + 2t + e % 2.
  __device__ __forceinline__ bool outside(int m0, int nt, int e) const {
    const int query = m0 + warp_row + g + (e >> 1) * 8, key = my_key0 + nt * 8 + 2 * t + (e & 1);
    bool out = (key >= seqlen_k) | (query >= seqlen_q);
    if constexpr (Banded) out |= !band.sees(query, key);
    return out;
  }

  // P in place of s and dS in place of dp, for the step at query m0; lse and
  // delta are the step's rows (natural log).
  __device__ __forceinline__ void operator()(float (&s)[kNTiles][4], float (&dp)[kNTiles][4], int m0,
                                             const float* lse, const float* delta) const {
    const bool needs_masking = my_key0 + Keys > seqlen_k || m0 + BlockM > seqlen_q ||
                               (Banded && band.cuts(m0, BlockM, my_key0, Keys));
    uint32_t hidden = 0;  // bit 4 nt + e; a test per element in the loop below would branch per element
    if (needs_masking) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) hidden |= uint32_t(outside(m0, nt, e)) << (4 * nt + e);
    }
    float lse2[2], row_delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lse2[h] = lse_in_log2(lse[warp_row + g + 8 * h]);
      row_delta[h] = delta[warp_row + g + 8 * h];
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const bool is_hidden = (hidden >> (4 * nt + e)) & 1u;
        const float prob = is_hidden ? 0.0f : exp2f(s[nt][e] * scale_log2 - lse2[h]);
        s[nt][e] = prob;
        dp[nt][e] = is_hidden ? 0.0f : prob * (dp[nt][e] - row_delta[h]);
      }
    }
  }
};

}  // namespace fusedattn::cuda
