// Runtime (dtype, head dim) -> the compile-time instantiation, forward and
// backward.
#include <cuda_runtime.h>

#include <string>

#include "../common/instantiation_dispatch.h"
#include "../tile_size.h"
#include "backward_sm80.h"
#include "forward_sm80.h"

namespace fusedattn::cuda {

void forward_sm80(const ForwardParams& p, const Plan& plan, cudaStream_t stream) {
  if (plan.family != Family::Sm80 || plan.block_m != kSm80ForwardBlockM || plan.block_n != kSm80ForwardBlockN ||
      plan.warps != kSm80Warps)
    throw_planner_bug("the sm80 forward runs " + std::to_string(kSm80ForwardBlockM) + " x " +
                      std::to_string(kSm80ForwardBlockN) + " tiles only, got the plan " + plan.describe());
  dispatch_instantiation(Sm80ForwardHeadDims{}, "sm80 forward", p.dtype, p.shape.head_dim,
                         [&](auto head_dim, auto element) {
                           launch_forward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
                         });
}

void backward_sm80(const BackwardParams& p, const Plan& plan, cudaStream_t stream) {
  const int d = static_cast<int>(p.fwd.shape.head_dim);
  if (plan.family != Family::Sm80 || plan.block_m != sm80_backward_block_m(d) ||
      plan.block_n != kSm80BackwardBlockN || plan.warps != kSm80Warps || plan.head_splits != p.head_splits ||
      plan.deterministic != p.deterministic)
    throw_planner_bug("the sm80 backward at head dim " + std::to_string(d) + " cannot run the plan " +
                      plan.describe());
  dispatch_instantiation(Sm80BackwardHeadDims{}, "sm80 backward", p.fwd.dtype, p.fwd.shape.head_dim,
                         [&](auto head_dim, auto element) {
                           launch_backward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
                         });
}

}  // namespace fusedattn::cuda
