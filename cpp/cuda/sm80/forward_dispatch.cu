// Runtime (dtype, head dim) -> the compile-time instantiation.
#include "../common/instantiation_dispatch.h"
#include "forward_sm80.h"

namespace fusedattn::cuda {

void forward_sm80(const ForwardParams& p, cudaStream_t stream) {
  dispatch_instantiation<32, 64, 128>("sm80 forward", p.dtype, p.shape.head_dim, [&](auto head_dim, auto element) {
    launch_forward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
  });
}

}  // namespace fusedattn::cuda
