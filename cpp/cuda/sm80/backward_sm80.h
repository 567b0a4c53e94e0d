// The sm80 family's backward: FlashAttention 2's algorithm on mma.sync tensor
// cores, for compute capability 8.0 and newer.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// Writes p.grad_q, p.grad_k, p.grad_v on `stream`, using p.delta, (unless
// p.deterministic) p.grad_q_accum and (when p.head_splits > 1)
// p.grad_kv_accum as workspaces. p.fwd.dtype must be Float16
// or BFloat16 and the head dim one of Sm80BackwardHeadDims. By default dQ is summed
// with float32 atomics, whose order (and so the last bits) varies between
// runs; p.deterministic computes it in a separate pass instead. `plan` is
// plan_backward's (family sm80); throws std::logic_error (a planner bug) for
// one it cannot run, std::runtime_error on a CUDA error.
void backward_sm80(const BackwardParams& p, const Plan& plan, cudaStream_t stream);

// One instantiation per (head dim, element type), each in its own file.
template <int HeadDim, typename Element>
void launch_backward_sm80(const BackwardParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
