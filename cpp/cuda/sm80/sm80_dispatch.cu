// Runtime (dtype, head dim) -> the compile-time instantiation, forward and
// backward.
#include <cuda_runtime.h>

#include "../common/instantiation_dispatch.h"
#include "backward_sm80.h"
#include "forward_sm80.h"

namespace fusedattn::cuda {

void forward_sm80(const ForwardParams& p, cudaStream_t stream) {
  dispatch_instantiation(Sm80ForwardHeadDims{}, "sm80 forward", p.dtype, p.shape.head_dim,
                         [&](auto head_dim, auto element) {
                           launch_forward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
                         });
}

void backward_sm80(const BackwardParams& p, cudaStream_t stream) {
  dispatch_instantiation(Sm80BackwardHeadDims{}, "sm80 backward", p.fwd.dtype, p.fwd.shape.head_dim,
                         [&](auto head_dim, auto element) {
                           launch_backward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
                         });
}

}  // namespace fusedattn::cuda
