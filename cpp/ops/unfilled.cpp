#include "unfilled.h"

#include <ATen/EmptyTensor.h>
#ifdef FUSEDATTN_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#endif

namespace fusedattn::ops {

// at::detail's allocators are at::empty's without the fill.
at::Tensor empty_unfilled(at::IntArrayRef sizes, const at::TensorOptions& options) {
  switch (options.device().type()) {
    case at::kCPU:
      return at::detail::empty_cpu(sizes, options);
#ifdef FUSEDATTN_WITH_CUDA
    case at::kCUDA:
      return at::detail::empty_cuda(sizes, options);
#endif
    default:
      return at::empty(sizes, options);
  }
}

}  // namespace fusedattn::ops
