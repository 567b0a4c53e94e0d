// The sm80 family's backward: FlashAttention 2's algorithm on mma.sync tensor
// cores, for compute capability 8.0 and newer.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Writes p.grad_q, p.grad_k, p.grad_v on `stream`, using p.delta, (unless
// p.deterministic) p.grad_q_accum and (when p.head_splits > 1)
// p.grad_kv_accum as workspaces. p.fwd.dtype must be Float16
// or BFloat16 and the head dim one of kSm80HeadDims. By default dQ is summed
// with float32 atomics, whose order (and so the last bits) varies between
// runs; p.deterministic computes it in a separate pass instead. Throws
// std::runtime_error on a CUDA error.
void backward_sm80(const BackwardParams& p, cudaStream_t stream);

// Keys per block of the backward's main kernel, and blocks per SM (two fit
// at d=128, 242 registers).
inline constexpr int kBackwardBlockN = 64;
inline constexpr int kBackwardBlocksPerSm = 2;

// How many blocks share each kv head's query heads per key block (a divisor
// of Hq / Hkv; 1 when deterministic): enough for B x Hkv x key blocks x
// splits to fill the current device's SMs twice, for a family's kernel of
// keys_per_block keys and blocks_per_sm resident blocks.
int backward_head_splits(const BackwardParams& p, int keys_per_block, int blocks_per_sm);

// One instantiation per (head dim, element type), each in its own file.
template <int HeadDim, typename Element>
void launch_backward_sm80(const BackwardParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
