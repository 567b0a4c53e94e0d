// forward_kvcache's device-independent part: checks, and (for devices without
// a decode kernel) the in-place append of k_new/v_new followed by one
// attention problem per sequence over its valid prefix.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

#include "checks.h"

namespace fusedattn::ops {

// Checks shapes, dtypes and devices of every argument (not the values of
// cache_seqlens) and returns Nnew, the positions k_new/v_new append (0 if none).
int64_t check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                             const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new);

// Runs `forward(q_b, k_b, v_b, out_b, lse_b)` for every sequence b, where k_b
// and v_b are the first cache_seqlens[b] + Nnew cached positions (after the
// append), and returns (out, lse).
using SequenceForward = std::function<void(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& out,
                                           const at::Tensor& lse)>;

std::tuple<at::Tensor, at::Tensor> forward_kvcache_by_sequence(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const SequenceForward& forward);

}  // namespace fusedattn::ops
