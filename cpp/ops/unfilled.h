#pragma once

#include <ATen/ATen.h>

namespace fusedattn::ops {

// at::empty for a tensor a kernel writes in full before anything reads it:
// under torch.use_deterministic_algorithms, at::empty also fills new memory
// with NaN (torch.utils.deterministic.fill_uninitialized_memory), one more
// pass over every byte that such a tensor does not need.
at::Tensor empty_unfilled(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace fusedattn::ops
