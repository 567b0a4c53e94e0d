// The sm90 family's forward: wgmma on Hopper (compute capability 9.0, built
// for sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// Whether this build has the sm90 kernels (compiled for sm_90a) and the
// current device can run them.
bool sm90_available();

// Writes p.out and p.lse on `stream` as `plan` (plan_forward's, family sm90)
// says. p.work_counter: a device unsigned int the call may use (it zeroes it
// first). Throws std::logic_error for a plan it cannot run.
void forward_sm90(const ForwardParams& p, const Plan& plan, cudaStream_t stream);

struct Sm90ForwardArgs;  // forward_traits.h
template <int HeadDim, typename Element>
void launch_forward_sm90(const Sm90ForwardArgs& args, const Plan& plan, cudaStream_t stream);

}  // namespace fusedattn::cuda
