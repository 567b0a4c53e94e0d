// The launch both sm90 backward kernels share (d <= 128 and the wide one):
// their shared memory limit, deterministic mode's turn counters and walk
// order, the key-block scheduler's grid, the kernel.
#pragma once

#include <cuda_runtime.h>

#include "../common/key_block_scheduler.cuh"
#include "../common/launch_check.h"
#include "backward_traits.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

template <typename Tr, typename T, bool Banded, bool Ordered, typename Kernel>
void launch_sm90_key_blocks(Kernel kernel, const Sm90BackwardArgs& args, cudaStream_t stream) {
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  Sm90BackwardArgs launch_args = args;
  if constexpr (Ordered) {  // the turn counters start at 0 (none when there are no queries)
    if (const int64_t counters = dq_turn_counters(args.p.fwd, Tr::kBlockM, Tr::kConsumers); counters > 0) {
      if (args.p.dq_turns == nullptr) throw_planner_bug("the sm90 backward's deterministic mode needs p.dq_turns");
      FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(args.p.dq_turns, 0, counters * sizeof(int), stream));
    }
    // A packed call's list puts a sequence's key tiles of every kv head side
    // by side, so its pairs are not launched one at a time: it keeps the
    // last-first order (dq_rotation_blocks 0).
    launch_args.dq_rotation_blocks = args.p.fwd.varlen.on() ? 0 : dq_rotation_blocks(current_device_sms());
  }
  const KeyBlockGrid grid = key_block_grid(args.p, Tr::kBlockN, sizeof(T), Banded, launch_args.dq_rotation_blocks);
  launch_args.order = grid.order;
  kernel<<<grid.blocks, Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
