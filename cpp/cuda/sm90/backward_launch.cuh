// The launch both sm90 backward kernels share (d <= 128 and the wide one):
// their shared memory limit, the key-block scheduler's grid, the kernel.
#pragma once

#include <cuda_runtime.h>

#include "../common/key_block_scheduler.cuh"
#include "../common/launch_check.h"
#include "backward_traits.h"

namespace fusedattn::cuda {

template <typename Tr, typename T, bool Banded, typename Kernel>
void launch_sm90_key_blocks(Kernel kernel, const Sm90BackwardArgs& args, cudaStream_t stream) {
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const KeyBlockGrid grid = key_block_grid(args.p, Tr::kBlockN, sizeof(T), Banded, args.dq_rotation_blocks);
  Sm90BackwardArgs launch_args = args;
  launch_args.order = grid.order;
  kernel<<<grid.blocks, Tr::kThreads, Tr::kSmemBytes, stream>>>(launch_args);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
