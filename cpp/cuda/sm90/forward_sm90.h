// The sm90 family's forward: wgmma on Hopper (compute capability 9.0, built
// for sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Head dims this family is instantiated for.
inline constexpr int kSm90HeadDims[] = {64, 128};
// The head dim it takes attn_mask at: d=64's three consumer warpgroups have
// no registers left for the mask reads (ptxas spills).
inline constexpr int kSm90MaskedHeadDim = 128;

// Whether this build has the sm90 kernels (compiled for sm_90a) and the
// current device can run them.
bool sm90_available();

// Writes p.out and p.lse on `stream` and returns true; or returns false,
// launching nothing, when the tensor memory accelerator cannot describe q, k
// or v (see tensor_maps.h). p.dtype must be Float16 or BFloat16,
// p.shape.head_dim one of kSm90HeadDims; a mask only at kSm90MaskedHeadDim;
// without a mask p.scale >= FLT_MIN (the kernel applies it in the exponent,
// forward_kernel.cuh; use_sm90_forward sends other scales to sm80);
// p.work_counter a device unsigned int the call may use (it zeroes it first).
bool forward_sm90(const ForwardParams& p, cudaStream_t stream);

struct Sm90ForwardArgs;  // forward_kernel.cuh
template <int HeadDim, typename Element>
void launch_forward_sm90(const Sm90ForwardArgs& args, cudaStream_t stream);

}  // namespace fusedattn::cuda
