// The band of keys a query sees under is_causal and a sliding window
// (params.h), as every CUDA kernel tests it: query i sees key j iff
//   lower <= j - i <= upper,
// lower = causal_offset - window_left, upper = causal_offset + band_right(),
// an open side at -kBandOpen or +kBandOpen. Kernels compiled "banded" read
// the band at run time, so one instantiation serves causal calls and windows;
// an unbanded kernel sees every key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Wider than any call's lengths (the operators cap a window at Nq + Nk and
// the kernels take at most 2^31 keys), small enough that i + kBandOpen
// cannot overflow int64.
inline constexpr int64_t kBandOpen = int64_t(1) << 40;

struct Band {
  int64_t lower = -kBandOpen, upper = kBandOpen;
  int64_t seqlen_q = 0, seqlen_k = 0;

  __host__ __device__ static Band of(const ForwardParams& p) { return of(p, p.shape.seqlen_k); }
  // With the keys' length given (a decoded sequence's own length).
  __host__ __device__ static Band of(const ForwardParams& p, int64_t seqlen_k) {
    return of(p, p.shape.seqlen_q, seqlen_k);
  }
  // is_causal alone (bottom-right aligned), for callers without ForwardParams.
  __host__ __device__ static Band causal(bool is_causal, int64_t seqlen_q, int64_t seqlen_k) {
    Band b;
    if (is_causal) b.upper = seqlen_k - seqlen_q;
    b.seqlen_q = seqlen_q;
    b.seqlen_k = seqlen_k;
    return b;
  }
  // With both lengths given (a packed sequence's).
  __host__ __device__ static Band of(const ForwardParams& p, int64_t seqlen_q, int64_t seqlen_k) {
    Band b;
    const int64_t offset = seqlen_k - seqlen_q;
    if (p.window_left >= 0) b.lower = offset - p.window_left;
    if (p.band_right() >= 0) b.upper = offset + p.band_right();
    b.seqlen_q = seqlen_q;
    b.seqlen_k = seqlen_k;
    return b;
  }

  // The keys [key_begin(i), key_end(i)) that query i sees (empty when
  // key_end <= key_begin); a block of queries [i0, i1) sees
  // [key_begin(i0), key_end(i1 - 1)).
  __host__ __device__ int64_t key_begin(int64_t i) const { return clamp(i + lower, seqlen_k); }
  __host__ __device__ int64_t key_end(int64_t i) const { return clamp(i + upper + 1, seqlen_k); }
  __host__ __device__ bool sees(int64_t i, int64_t j) const { return j - i >= lower && j - i <= upper; }
  // The queries [query_begin(j), query_end(j)) that see key j.
  __host__ __device__ int64_t query_begin(int64_t j) const { return clamp(j - upper, seqlen_q); }
  __host__ __device__ int64_t query_end(int64_t j) const { return clamp(j - lower + 1, seqlen_q); }

  // Whether a tile of queries [i0, i0 + rows) by keys [j0, j0 + cols) holds
  // an entry outside the band (then its entries are tested one by one).
  __host__ __device__ bool cuts(int64_t i0, int64_t rows, int64_t j0, int64_t cols) const {
    return j0 + cols - 1 - i0 > upper || j0 - (i0 + rows - 1) < lower;
  }
  // The tile-local band of a tile whose first query is i0 and first key j0:
  // entry (r, c) is inside iff lo <= c - r <= hi, as 32-bit ints (clamped to
  // +-span, span at least the tile's rows + columns).
  __host__ __device__ void local(int64_t i0, int64_t j0, int span, int& lo, int& hi) const {
    lo = static_cast<int>(clamp_signed(lower - (j0 - i0), span));
    hi = static_cast<int>(clamp_signed(upper - (j0 - i0), span));
  }

 private:
  __host__ __device__ static int64_t clamp(int64_t x, int64_t n) { return x < 0 ? 0 : x > n ? n : x; }
  __host__ __device__ static int64_t clamp_signed(int64_t x, int64_t span) {
    return x < -span ? -span : x > span ? span : x;
  }
};

// Which sides of its band a kernel tests, fixed at compile time where the
// tests sit in a per-tile loop: none (every key is seen), the right only
// (is_causal, or a window without a left side: no key is hidden on the left),
// or both.
enum class BandSides { kNone, kRight, kBoth };

inline BandSides band_sides(const ForwardParams& p) {
  return !p.banded() ? BandSides::kNone : p.window_left >= 0 ? BandSides::kBoth : BandSides::kRight;
}

// f(std::integral_constant<BandSides, sides>{}): the call's sides as the
// kernel's compile-time ones.
template <typename F>
decltype(auto) with_band_sides(BandSides sides, F&& f) {
  using None = std::integral_constant<BandSides, BandSides::kNone>;
  using Right = std::integral_constant<BandSides, BandSides::kRight>;
  using Both = std::integral_constant<BandSides, BandSides::kBoth>;
  if (sides == BandSides::kNone) return f(None{});
  if (sides == BandSides::kRight) return f(Right{});
  return f(Both{});
}

// The longest sequence a kernel that tests its band in 32 bits (Band32)
// takes: 256 short of 2^30, so that a row of a block's padding (up to a
// tile past the end) plus an open bound still stays under 2^31.
inline constexpr int64_t kBand32MaxLength = (int64_t(1) << 30) - 256;

// The band of one sequence of at most kBand32MaxLength queries and keys (the
// sm90 kernels' planner refusals say so), in 32 bits: a kernel's per-tile
// tests then hold no int64 registers (the sm90 kernels spilled for them).
// Open sides are clamped to -+2^30, which no j - i inside a sequence
// reaches, and every term of the tests below stays under 2^31.
struct Band32 {
  int lower = 0, upper = 0;

  __host__ __device__ static Band32 of(const Band& b) {
    constexpr int64_t kOpen = int64_t(1) << 30;
    Band32 r;
    r.lower = static_cast<int>(b.lower < -kOpen ? -kOpen : b.lower);
    r.upper = static_cast<int>(b.upper > kOpen ? kOpen : b.upper);
    return r;
  }
  // Band::of(p, seqlen_q, seqlen_k) narrowed: a kernel takes it per work item
  // and then asks key_begin and key_end of it in 32 bits.
  __host__ __device__ static Band32 of(const ForwardParams& p, int64_t seqlen_q, int64_t seqlen_k) {
    return of(Band::of(p, seqlen_q, seqlen_k));
  }
  __host__ __device__ bool sees(int i, int j) const { return j - i >= lower && j - i <= upper; }
  // Band::cuts, for a tile of at most 2^30 rows and columns, and its two
  // sides apart: an entry right of the band (above the diagonal, causally),
  // or left of it (a window's left side).
  __host__ __device__ bool cuts(int i0, int rows, int j0, int cols) const {
    return cuts_right(i0, j0, cols) || cuts_left(i0, rows, j0);
  }
  __host__ __device__ bool cuts_right(int i0, int j0, int cols) const { return j0 + cols - 1 - i0 > upper; }
  __host__ __device__ bool cuts_left(int i0, int rows, int j0) const { return j0 - (i0 + rows - 1) < lower; }
  // Band::key_begin and key_end of a sequence of seqlen_k keys.
  __host__ __device__ int key_begin(int i, int seqlen_k) const { return clamp(i + lower, seqlen_k); }
  __host__ __device__ int key_end(int i, int seqlen_k) const { return clamp(i + upper + 1, seqlen_k); }

 private:
  __host__ __device__ static int clamp(int x, int n) { return x < 0 ? 0 : x > n ? n : x; }
};

}  // namespace fusedattn::cuda
