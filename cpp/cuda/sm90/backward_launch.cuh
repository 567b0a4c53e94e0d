// The launch both sm90 backward kernels share (d <= 128 and the wide one):
// their shared memory limit, deterministic mode's turn counters zeroed, the
// key-block scheduler's grid, the kernel.
#pragma once

#include <cuda_runtime.h>

#include "../common/key_block_scheduler.cuh"
#include "../common/launch_check.h"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <typename Tr, typename T, bool Banded, typename Kernel>
void launch_sm90_key_blocks(Kernel kernel, const Sm90BackwardArgs& args, cudaStream_t stream) {
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const int64_t counters = args.p.deterministic ? dq_turn_counters(args.p.fwd, Tr::kBlockM, Tr::kConsumers) : 0;
  if (counters > 0) {  // none when there are no queries
    if (args.p.dq_turns == nullptr) throw_planner_bug("the sm90 backward's deterministic mode needs p.dq_turns");
    FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(args.p.dq_turns, 0, counters * sizeof(int), stream));
  }
  const KeyBlockGrid grid = key_block_grid(args.p, Tr::kBlockN, sizeof(T), Banded);
  Sm90BackwardArgs launch_args = args;
  launch_args.order = grid.order;
  kernel<<<grid.blocks, Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
