// The sm90 family's backward: the key-block kernel on wgmma (compute
// capability 9.0, built for sm_90a), around the kernels both families share.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// Writes p.grad_q, p.grad_k, p.grad_v on `stream`, like backward_sm80, for a
// call plan_backward gave family sm90 (`plan`; p.head_splits its count).
// Throws std::logic_error (a planner bug) for a plan it cannot run, or where
// the tensor memory accelerator cannot describe the operands after all.
void backward_sm90(const BackwardParams& p, const Plan& plan, cudaStream_t stream);

// How many ints p.dq_turns must hold for a call `plan` gave family sm90 (0
// unless plan.ordered_dq()); the ordered kernels' launch zeroes them.
int64_t sm90_backward_dq_turns(const ForwardParams& p, const Plan& plan);

struct Sm90BackwardArgs;  // backward_traits.h
template <int HeadDim, typename Element>
void launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream);

}  // namespace fusedattn::cuda
