// Merging the splits of decode_kernel for one row of [B, Hq, Nq]:
//   lse = log sum_s e^(lse_s),   out = sum_s e^(lse_s - lse) out_s
// where out_s is split s's output normalised by its own softmax sum. A split
// that saw no key has lse_s = -inf and weighs nothing. The last block of a
// (sequence, kv head, row tile) to finish calls it, one warp per row, so the
// partials are read through L2 (__ldcg): other blocks wrote them.
#pragma once

#include <cmath>

#include "../common/device_math.cuh"
#include "kvcache_common.cuh"

namespace fusedattn::cuda {

template <typename T>
__device__ __forceinline__ void merge_splits(const KVCacheParams& p, int64_t row, int lane) {
  const AttentionShape& sh = p.attn.shape;
  const int64_t rows_total = sh.batch * sh.heads_q * sh.seqlen_q;
  const int64_t batch = row / (sh.heads_q * sh.seqlen_q);
  const int64_t head = row / sh.seqlen_q % sh.heads_q, query = row % sh.seqlen_q;
  const float* split_lse = p.partial_lse + row;  // split s at s * rows_total

  float m = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, __ldcg(split_lse + s * rows_total));
  float sum = 0.0f;
  if (m != -INFINITY)
    for (int s = 0; s < p.num_splits; ++s) sum += expf(__ldcg(split_lse + s * rows_total) - m);
  const bool valid = kv_length(p, batch) >= 0;
  const float lse = !valid ? NAN : sum > 0.0f ? m + logf(sum) : -INFINITY;

  T* out = static_cast<T*>(p.attn.out) + batch * p.attn.out_strides.batch + head * p.attn.out_strides.head +
           query * p.attn.out_strides.row;
  for (int col = 4 * lane; col < sh.head_dim; col += 4 * 32) {
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (sum > 0.0f) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float lse_s = __ldcg(split_lse + s * rows_total);
        if (lse_s == -INFINITY) continue;
        const float w = expf(lse_s - lse);
        const float4 x =
            __ldcg(reinterpret_cast<const float4*>(p.partial_out + (s * rows_total + row) * sh.head_dim + col));
        o.x += w * x.x;
        o.y += w * x.y;
        o.z += w * x.z;
        o.w += w * x.w;
      }
    }
    if (!valid) o = make_float4(NAN, NAN, NAN, NAN);
    uint2 packed = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
    *reinterpret_cast<uint2*>(out + col) = packed;
  }
  if (lane == 0) p.attn.lse[row] = lse;
}

}  // namespace fusedattn::cuda
