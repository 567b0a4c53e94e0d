// The sm90 family's backward: the key-block kernel on wgmma (compute
// capability 9.0, built for sm_90a), around the kernels both families share.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Head dims this family's backward is instantiated for.
inline constexpr int kSm90BackwardHeadDims[] = {64, 128};

// Writes p.grad_q, p.grad_k, p.grad_v on `stream`, like backward_sm80 but
// only for: no attn_mask, not deterministic, p.fwd.shape.head_dim in
// kSm90BackwardHeadDims, Float16 or BFloat16, on a device where
// sm90_available(). Its blocks own 64 keys, as the sm80 kernel's
// (kBackwardBlockN), so backward_head_splits applies. Throws
// std::invalid_argument for a call it does not take.
void backward_sm90(const BackwardParams& p, cudaStream_t stream);

template <int HeadDim, typename Element>
void launch_backward_sm90(const BackwardParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
