// Tiled online-softmax attention on the CPU (FlashAttention 2's algorithm with
// ATen BLAS for the tile GEMMs). Memory beyond the outputs is O(tile) per
// thread: the Nq x Nk score matrix is never formed.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "fusedattn/dispatch.h"
#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cpu {

// Element type of each DType on the CPU.
template <DType D>
using scalar_of = std::conditional_t<
    D == DType::Float32, float,
    std::conditional_t<D == DType::Float16, c10::Half, c10::BFloat16>>;

// Tile sizes. Forward: 256 queries per task amortise each key tile's
// transposed copy over more rows, which is what matters; the key tile's width
// matters less (docs/tuning.md, docs/cpu-notes.md).
inline constexpr int64_t kForwardBlockQ = 256;
inline constexpr int64_t kForwardBlockK = 256;
inline constexpr int64_t kBackwardBlockQ = 64;
inline constexpr int64_t kBackwardBlockK = 128;

// The CPU kernels' plan: one family, fixed tiles.
inline Plan plan(bool backward) {
  Plan p;
  p.family = Family::Cpu;
  p.backward = backward;
  p.block_m = static_cast<int>(backward ? kBackwardBlockQ : kForwardBlockQ);
  p.block_n = static_cast<int>(backward ? kBackwardBlockK : kForwardBlockK);
  return p;
}

// The gemm family on the CPU (cpp/ops/gemm_attention.h), where forced (the
// tiled kernels serve every call): blocks of 2^21 float32 scores, 8 MB, stay
// near the caches.
inline constexpr int64_t kGemmScoreElements = int64_t(1) << 21;
inline Plan plan_gemm(const ForwardParams& p, bool backward) {
  const AttentionShape& sh = p.shape;
  return fusedattn::plan_gemm(sh.batch * sh.heads_q, sh.seqlen_q, sh.seqlen_k, sh.head_dim, kGemmScoreElements,
                              backward);
}

// Writes p.out and p.lse.
void forward(const ForwardParams& p);

// Writes p.grad_q, p.grad_k and p.grad_v; reads p.fwd.out and p.fwd.lse.
void backward(const BackwardParams& p);

}  // namespace fusedattn::cpu
