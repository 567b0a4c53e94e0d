// Runtime (dtype, head dim) -> the compile-time instantiation, forward and
// backward; the backward's split of query heads over blocks.
#include <cuda_runtime.h>

#include "../common/instantiation_dispatch.h"
#include "../common/launch_check.h"
#include "backward_sm80.h"
#include "forward_sm80.h"

namespace fusedattn::cuda {

void forward_sm80(const ForwardParams& p, cudaStream_t stream) {
  dispatch_instantiation<32, 64, 128>("sm80 forward", p.dtype, p.shape.head_dim, [&](auto head_dim, auto element) {
    launch_forward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
  });
}

int backward_head_splits(const BackwardParams& p, int keys_per_block, int blocks_per_sm) {
  const AttentionShape& sh = p.fwd.shape;
  const int64_t group = sh.heads_q / sh.heads_kv;
  if (p.deterministic || group == 1) return 1;  // the splits' sums are float32 atomics
  // Two waves of the blocks that fit at once.
  const int64_t target = 2 * int64_t(blocks_per_sm) * current_device_sms();
  const int64_t blocks = (sh.seqlen_k + keys_per_block - 1) / keys_per_block * sh.heads_kv * sh.batch;
  for (int64_t s = 1; s < group; ++s)
    if (group % s == 0 && blocks * s >= target) return static_cast<int>(s);
  return static_cast<int>(group);
}

void backward_sm80(const BackwardParams& p, cudaStream_t stream) {
  dispatch_instantiation<32, 64, 128>("sm80 backward", p.fwd.dtype, p.fwd.shape.head_dim,
                                      [&](auto head_dim, auto element) {
    launch_backward_sm80<decltype(head_dim)::value, decltype(element)>(p, stream);
  });
}

}  // namespace fusedattn::cuda
