// The sm80 family's forward: FlashAttention 2's algorithm on mma.sync tensor
// cores, for compute capability 8.0 and newer.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// Writes p.out and p.lse on `stream`, for a call plan_forward gave family
// sm80. p.dtype must be Float16 or BFloat16 and p.shape.head_dim one of
// Sm80ForwardHeadDims (instantiations.h). Throws std::logic_error (a planner
// bug) for a plan whose tiles it has no kernel of, std::runtime_error on a CUDA error.
void forward_sm80(const ForwardParams& p, const Plan& plan, cudaStream_t stream);

// One instantiation per (head dim, element type), each in its own file.
template <int HeadDim, typename Element>
void launch_forward_sm80(const ForwardParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
