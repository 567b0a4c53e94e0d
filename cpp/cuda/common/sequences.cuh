// Where a block's sequence lies, dense or packed (VarlenParams, params.h),
// for the kernels that take both: the sm80 forward, backward and dQ pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "block_order.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// One sequence's rows: its queries are rows [q0, q0 + seqlen_q) of its
// batch's [N, d] heads, its keys rows [k0, k0 + seqlen_k). Offsets into
// lse-shaped arrays ([B, Hq, N]) are (batch * Hq + head) * N + q0 + row.
struct SequenceRows {
  int64_t batch, q0, k0, seqlen_q, seqlen_k;

  // Dense: batch b of the call's shape. Packed (p.varlen.on(), which a
  // kernel may pass as a constant false where it takes no packed calls):
  // sequence b of cu_seqlens (or of a KV cache), in batch 0.
  __device__ static SequenceRows of(const ForwardParams& p, unsigned b, bool packed) {
    if (!packed) return {b, 0, 0, p.shape.seqlen_q, p.shape.seqlen_k};
    const int64_t q0 = p.varlen.cu_seqlens_q[b];
    if (p.varlen.seqused_k != nullptr)  // a KV cache (VarlenParams)
      return {0, q0, b * p.varlen.cache_rows, p.varlen.cu_seqlens_q[b + 1] - q0, p.varlen.seqused_k[b]};
    const int64_t k0 = p.varlen.cu_seqlens_k[b];
    return {0, q0, k0, p.varlen.cu_seqlens_q[b + 1] - q0, p.varlen.cu_seqlens_k[b + 1] - k0};
  }
};

// Block `index` of a packed call's grid over `items` (VarlenParams'
// query_tiles or key_tiles) and `heads` heads: pair = sequence x heads +
// head, block = the item's tile; the heads of one item are neighbours.
__device__ __forceinline__ GridBlock work_item(const int32_t* items, unsigned index, unsigned heads) {
  const unsigned item = index / heads;
  return {static_cast<unsigned>(items[2 * item]) * heads + index % heads, static_cast<unsigned>(items[2 * item + 1])};
}

// The blocks of a grid: order's, or a packed call's items x heads.
inline unsigned grid_blocks(const BlockOrder& order, bool packed, int64_t items, int64_t heads) {
  const int64_t blocks = packed ? items * heads : order.blocks();
  if (blocks > 2147483647) throw std::runtime_error("fusedattn: the call's blocks exceed one launch (2^31 - 1)");
  return static_cast<unsigned>(blocks);
}

}  // namespace fusedattn::cuda
