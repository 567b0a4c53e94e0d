// Where one sequence of a call lies, dense or packed (VarlenParams,
// params.h): the CUDA kernels' blocks (cuda/common/sequences.cuh) and the CPU
// kernels' tasks (cpu/sequences.h) find their sequence here.
#pragma once

#include <cstdint>

#include "params.h"

namespace fusedattn {

// One sequence's rows: its queries are rows [q0, q0 + seqlen_q) of its
// batch's [N, d] heads, its keys rows [k0, k0 + seqlen_k).
struct SequenceRows {
  int64_t batch, q0, k0, seqlen_q, seqlen_k;

  // Dense: batch b of the call's shape. Packed (p.varlen.on(), which a
  // kernel may pass as a constant false where it takes no packed calls):
  // sequence b of cu_seqlens (or of a KV cache), in batch 0.
  FUSEDATTN_HOST_DEVICE static SequenceRows of(const ForwardParams& p, unsigned b, bool packed) {
    if (!packed) return {b, 0, 0, p.shape.seqlen_q, p.shape.seqlen_k};
    const int64_t q0 = p.varlen.cu_seqlens_q[b];
    if (p.varlen.seqused_k != nullptr)  // a KV cache (VarlenParams)
      return {0, q0, b * p.varlen.cache_rows, p.varlen.cu_seqlens_q[b + 1] - q0, p.varlen.seqused_k[b]};
    const int64_t k0 = p.varlen.cu_seqlens_k[b];
    return {0, q0, k0, p.varlen.cu_seqlens_q[b + 1] - q0, p.varlen.cu_seqlens_k[b + 1] - k0};
  }

  // Where row `row` of the sequence's head `head` lies in the call's
  // lse-shaped arrays ([B, Hq, N]; a packed call's [1, Hq, total_q]).
  FUSEDATTN_HOST_DEVICE int64_t lse_index(const AttentionShape& call, int64_t head, int64_t row) const {
    return (batch * call.heads_q + head) * call.seqlen_q + q0 + row;
  }
};

}  // namespace fusedattn
