// Merging the splits of decode_kernel for one row of [B, Hq, Nq]:
//   lse = log (sum_s e^(lse_s) + e^sink),   out = sum_s e^(lse_s - lse) out_s
// where out_s is split s's output normalised by its own softmax sum (and the
// sink term is there only with sinks). A split that saw no key has lse_s =
// -inf and weighs nothing. One warp merges a row,
// reading the partials from one of two places:
//   GlobalPartials   p.partial_out / p.partial_lse, written by the other
//                    blocks of the row's (sequence, kv head, row tile): the
//                    last of them to finish merges, reading through L2 (__ldcg)
//   ClusterPartials  the shared memory of the blocks of this block's cluster,
//                    one per split (split s = cluster rank s)
#pragma once

#include <cmath>

#include "../hopper/cluster.cuh"
#include "../common/device_math.cuh"
#include "forward_kvcache.h"
#include "kvcache_common.cuh"

namespace fusedattn::cuda {

struct GlobalPartials {
  const float* lse_row;  // split s at s * rows_total
  const float* out_row;  // split s at s * rows_total * head_dim
  int64_t rows_total, head_dim;
  __device__ GlobalPartials(const KVCacheParams& p, int64_t row) {
    const AttentionShape& sh = p.attn.shape;
    rows_total = sh.batch * sh.heads_q * sh.seqlen_q;
    head_dim = sh.head_dim;
    lse_row = p.partial_lse + row;
    out_row = p.partial_out + row * head_dim;
  }
  __device__ float lse(int s) const { return __ldcg(lse_row + s * rows_total); }
  __device__ float4 load(int s, int col) const {
    return __ldcg(reinterpret_cast<const float4*>(out_row + s * rows_total * head_dim + col));
  }
};

// A row's partial in each block's shared memory, at the same offsets in all:
// out_row[0, head_dim) and *lse_row.
struct ClusterPartials {
  const float* lse_row;
  const float* out_row;
  __device__ float lse(int s) const { return ld_cluster_f32(cluster_address(lse_row, s)); }
  __device__ float4 load(int s, int col) const { return ld_cluster_f32x4(cluster_address(out_row + col, s)); }
};

// The split LSEs are read once, two per lane (kMaxDecodeSplits <= 64), and
// the partial rows in groups of kInFlight loads: at a short cache's end the
// merge is the kernel's tail, and one L2 round trip per split was most of it.
template <typename T, typename Partials>
__device__ __forceinline__ void merge_splits(const KVCacheParams& p, int64_t row, int lane, const Partials& partials) {
  static_assert(kMaxDecodeSplits <= 64, "two split LSEs per lane");
  constexpr int kInFlight = 8;
  const AttentionShape& sh = p.attn.shape;
  const int64_t batch = row / (sh.heads_q * sh.seqlen_q);
  const int splits = p.num_splits;

  float lse_s[2];  // splits lane and lane + 32
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + 32 * i;
    lse_s[i] = s < splits ? partials.lse(s) : -INFINITY;
  }
  // The head's sink joins as one more term of no value (the splits left it out).
  const float sink = p.attn.sinks ? p.attn.sinks[row / sh.seqlen_q % sh.heads_q] : -INFINITY;
  const float m = fmaxf(warp_max(fmaxf(lse_s[0], lse_s[1])), sink);
  const float sum = (m == -INFINITY ? 0.0f : expf(sink - m)) +
                    warp_sum(m == -INFINITY ? 0.0f : expf(lse_s[0] - m) + expf(lse_s[1] - m));
  // A split that met a page outside the cache wrote NaN (decode_kernel).
  const bool valid =
      kv_length(p, batch) >= 0 && !__any_sync(0xffffffff, isnan(lse_s[0]) || isnan(lse_s[1]));
  const float lse = !valid ? NAN : sum > 0.0f ? m + logf(sum) : -INFINITY;
  // Each split's weight e^(lse_s - lse), on the lane that read its LSE (a
  // row that saw no key has every lse_s at -inf: all weights 0).
  float weight[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) weight[i] = lse_s[i] == -INFINITY ? 0.0f : expf(lse_s[i] - lse);

  // Lane l merges columns [4 l, 4 l + 4) of each 128 columns; every lane
  // takes part in the shuffles.
  T* out = static_cast<T*>(p.attn.out) + output_offset(p.attn, row);
  for (int col0 = 0; col0 < sh.head_dim; col0 += 4 * 32) {
    const int col = col0 + 4 * lane;
    const bool active = col < sh.head_dim;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = 0; s0 < splits; s0 += kInFlight) {
      float4 x[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        x[j] = active && s0 + j < splits ? partials.load(s0 + j, col) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        const int s = s0 + j;  // the same on every lane
        const float w = __shfl_sync(0xffffffff, s < 32 ? weight[0] : weight[1], s % 32);
        o.x += w * x[j].x;
        o.y += w * x[j].y;
        o.z += w * x[j].z;
        o.w += w * x[j].w;
      }
    }
    if (!valid) o = make_float4(NAN, NAN, NAN, NAN);
    if (active) *reinterpret_cast<uint2*>(out + col) = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
  }
  if (lane == 0) p.attn.lse[row] = lse;
}

}  // namespace fusedattn::cuda
