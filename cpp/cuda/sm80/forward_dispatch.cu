// Runtime (dtype, head dim) -> the compile-time instantiation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "forward_sm80.h"

namespace fusedattn::cuda {

template <typename Element>
void forward_sm80_typed(const ForwardParams& p, cudaStream_t stream) {
  switch (p.shape.head_dim) {
    case 32: return launch_forward_sm80<32, Element>(p, stream);
    case 64: return launch_forward_sm80<64, Element>(p, stream);
    case 128: return launch_forward_sm80<128, Element>(p, stream);
    default:
      throw std::invalid_argument("fusedattn: no sm80 forward for head dim " +
                                  std::to_string(p.shape.head_dim));
  }
}

void forward_sm80(const ForwardParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::Float16: return forward_sm80_typed<__half>(p, stream);
    case DType::BFloat16: return forward_sm80_typed<__nv_bfloat16>(p, stream);
    default: throw std::invalid_argument("fusedattn: the sm80 forward takes float16 or bfloat16");
  }
}

}  // namespace fusedattn::cuda
