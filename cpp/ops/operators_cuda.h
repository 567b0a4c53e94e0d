// What the CUDA operators (attention_cuda_ops.cpp, varlen_cuda_ops.cpp,
// kvcache_cuda_ops.cpp) share: the kernels' support table, padding to the
// kernels' head dim, a plan's workspaces and launch, and forward_kvcache's
// packed queries (varlen_cuda_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <cuda_runtime.h>

#include <string>
#include <tuple>

#include "../cuda/plan.h"
#include "checks.h"
#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::ops {

// Any head dims d, d_v up to the largest the forward (or backward) serves:
// the kernels run them padded to kernel_head_dim.
const DeviceSupport& cuda_support(bool backward = false);
// fusedattn.forward and fusedattn.backward (and their plan): every dtype,
// head dim and option, the gemm family taking what the kernels do not.
const DeviceSupport& cuda_dense_support();

// Pads `prepared` (PreparedInputs or PreparedBackward, of shape sh) to the
// head dim the forward's (or backward's) kernels run it at; says whether it did.
template <typename Prepared>
bool pad_to_kernel_head_dim(Prepared& prepared, const AttentionShape sh, bool backward) {
  const int64_t head_dim =
      with_torch_errors([&] { return cuda::kernel_head_dim(sh.head_dim, sh.head_dim_v, backward); });
  if (head_dim == sh.head_dim && head_dim == sh.head_dim_v) return false;
  pad_head_dims(prepared, head_dim);
  return true;
}

PlanRequest family_request(const char* op, const std::optional<c10::string_view>& family, const at::Tensor& q);

// The current stream of q's device.
cudaStream_t stream_of(const at::Tensor& q);

// Launches the forward `plan` chose, with its workspaces (allocated like q).
void run_forward(ForwardParams& p, const Plan& plan, const at::Tensor& q, cudaStream_t stream);

// The backward's workspaces, as its plan needs them: delta always; the
// float32 dQ accumulator unless sm80's deterministic pass writes grad_q; the
// turn counters of sm90's deterministic mode; the dK/dV sums of the query
// heads' splits when there are any; the mask's tile lists by key tiles.
struct BackwardWorkspaces {
  at::Tensor delta, grad_q_accum, dq_turns, grad_kv_accum, mask_tiles;
  BackwardWorkspaces(BackwardParams& p, const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& lse);
};

// The backward's params for its plan alone: the forward's, with aligned
// stand-ins for lse and for grad_out, whose strides (contiguous like the
// call's out: fusedattn's autograd makes it so) the caller gives; nothing is read.
BackwardParams backward_plan_params(const ForwardParams& fwd, const TensorStrides& grad_out_strides);

// Launches the backward `plan` chose (its workspaces set in p).
void run_backward(const BackwardParams& p, const Plan& plan, cudaStream_t stream);

// forward_kvcache and plan_kvcache with cu_seqlens_q: the varlen forward
// over the caches' rows (varlen_cuda_ops.cpp); paged caches are gathered
// into a cache per sequence first (their lengths are read on the host anyway).
std::tuple<at::Tensor, at::Tensor> forward_packed_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    bool is_causal, std::optional<double> scale, std::optional<int64_t> num_splits,
    std::optional<bool> merge_in_cluster, std::optional<int64_t> warps, at::OptionalIntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& block_table);
std::string plan_packed_kvcache_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, bool is_causal,
                                     std::optional<double> scale, std::optional<int64_t> num_splits,
                                     std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
                                     at::OptionalIntArrayRef window, std::optional<double> softcap,
                                     const std::optional<at::Tensor>& sinks,
                                     const std::optional<at::Tensor>& block_table);

}  // namespace fusedattn::ops
