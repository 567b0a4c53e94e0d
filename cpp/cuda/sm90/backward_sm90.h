// The sm90 family's backward: the key-block kernel on wgmma (compute
// capability 9.0, built for sm_90a), around the kernels both families share.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Head dims this family's backward is instantiated for.
inline constexpr int kSm90BackwardHeadDims[] = {64, 128};

// Keys per block of the key-block kernel, and blocks per SM (for
// backward_head_splits).
inline constexpr int kSm90BackwardBlockN = 128;
inline constexpr int kSm90BackwardBlocksPerSm = 1;

// Writes p.grad_q, p.grad_k, p.grad_v on `stream` and returns true, like
// backward_sm80, for: no attn_mask, not deterministic, p.fwd.shape.head_dim
// in kSm90BackwardHeadDims, Float16 or BFloat16, on a device where
// sm90_available(), with p.head_splits counted for kSm90BackwardBlockN-key
// blocks. Returns false, launching nothing, when the tensor memory
// accelerator cannot describe the operands (see tensor_maps.h). Throws
// std::invalid_argument for a call it does not take.
bool backward_sm90(const BackwardParams& p, cudaStream_t stream);

struct Sm90BackwardArgs;  // backward_traits.h
template <int HeadDim, typename Element>
void launch_backward_sm90(const Sm90BackwardArgs& args, cudaStream_t stream);

}  // namespace fusedattn::cuda
