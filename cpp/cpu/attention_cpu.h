// Tiled online-softmax attention on the CPU (FlashAttention 2's algorithm with
// ATen BLAS for the tile GEMMs). Memory beyond the outputs is O(tile) per
// thread: the Nq x Nk score matrix is never formed.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "fusedattn/dispatch.h"
#include "fusedattn/params.h"

namespace fusedattn::cpu {

// Element type of each DType on the CPU.
template <DType D>
using scalar_of = std::conditional_t<
    D == DType::Float32, float,
    std::conditional_t<D == DType::Float16, c10::Half, c10::BFloat16>>;

// Writes p.out and p.lse.
void forward(const ForwardParams& p);

// Writes p.grad_q, p.grad_k and p.grad_v; reads p.fwd.out and p.fwd.lse.
void backward(const BackwardParams& p);

}  // namespace fusedattn::cpu
