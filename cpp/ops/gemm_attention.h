// The gemm family: attention from ATen's matrix products in float32, a block
// of query rows at a time (plan.block_m rows; a block's scores, [B, Hq, rows,
// Nk], bound the memory). It takes every dtype, head dim and option on any
// device; the CUDA planner gives it the calls no fused kernel takes
// (float32, head dims past the kernels').
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "checks.h"
#include "fusedattn/plan.h"

namespace fusedattn::ops {

// Writes out [B, Hq, Nq, d_v] (q's dtype; a view is fine, e.g. a sequence's
// rows of a packed output) and lse float32 [B, Hq, Nq] (natural log; -inf
// for a row that sees nothing and has no sink).
void gemm_forward(const PreparedInputs& in, const Plan& plan, const at::Tensor& out, const at::Tensor& lse);

// Writes b.grad_q, b.grad_k and b.grad_v (as prepare_backward allocated
// them) from b.out and b.lse; returns delta = rowsum(grad_out * out), float32
// [B, Hq, Nq], from which the caller takes the sinks' gradient.
at::Tensor gemm_backward(PreparedBackward& b, const Plan& plan);

}  // namespace fusedattn::ops
