// CUDA kernels of the fusedattn operators: checks, the plan's workspaces and the
// launch here; every choice in cpp/cuda/plan.cu. On the current stream of the inputs' device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include <ATen/Context.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../cuda/naive/softmax_rows.h"
#include "../cuda/plan.h"
#include "checks.h"
#include "gemm_attention.h"
#include "operators_cuda.h"

namespace fusedattn::ops {
namespace {

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                                std::optional<double> scale,
                                                std::optional<c10::string_view> family,
                                                at::OptionalIntArrayRef window, std::optional<double> softcap,
                                                const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.forward";
  PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cuda_dense_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());  // after the checks: q may be on the CPU
  const PlanRequest request = family_request(op, family, q);
  if (const auto gemm = with_torch_errors([&] { return cuda::plan_gemm(in.params, request, /*backward=*/false); })) {
    auto outputs = allocate_forward_outputs(in);
    gemm_forward(in, *gemm, std::get<0>(outputs), std::get<1>(outputs));
    return outputs;
  }
  const int64_t head_dim_v = in.params.shape.head_dim_v;
  pad_to_kernel_head_dim(in, in.params.shape, /*backward=*/false);
  auto [out, lse] = allocate_forward_outputs(in);
  const Plan plan = with_torch_errors([&] { return cuda::plan_forward(in.params, request); });
  run_forward(in.params, plan, q, stream_of(q));
  return {unpadded(out, head_dim_v), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.backward";
  PreparedBackward b = prepare_backward(op, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale,
                                        cuda_dense_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  const PlanRequest request = family_request(op, family, q);
  if (const auto gemm = with_torch_errors([&] { return cuda::plan_backward_gemm(b.params, request); })) {
    const at::Tensor delta = gemm_backward(b, *gemm);
    return {b.grad_q, b.grad_k, b.grad_v, sinks_gradient(sinks, lse, delta)};
  }
  pad_to_kernel_head_dim(b, b.params.fwd.shape, /*backward=*/true);
  // torch.use_deterministic_algorithms(True): grad_q summed in a fixed order
  // (the planner's family: sm90's ordered kernels or sm80's dQ pass), instead
  // of float32 atomics in any order.
  b.params.deterministic = at::globalContext().deterministicAlgorithms();
  const Plan plan = with_torch_errors([&] { return cuda::plan_backward(b.params, request); });
  const BackwardWorkspaces workspaces(b.params, plan, b.fwd.q, b.fwd.k, lse);
  run_backward(b.params, plan, stream_of(q));
  // The sinks' gradient from the delta the kernels computed.
  const at::Tensor grad_sinks = sinks_gradient(sinks, b.lse, workspaces.delta);
  return {unpadded(b.grad_q, q.size(3)), unpadded(b.grad_k, k.size(3)), unpadded(b.grad_v, v.size(3)), grad_sinks};
}

// The plan of forward (or backward) for these arguments; nothing is read.
std::string plan_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
                      std::optional<c10::string_view> family, bool backward, at::OptionalIntArrayRef window,
                      std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.plan";
  PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cuda_dense_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  const PlanRequest request = family_request(op, family, q);
  if (!backward) {
    if (const auto gemm = with_torch_errors([&] { return cuda::plan_gemm(in.params, request, false); }))
      return gemm->describe();
    pad_to_kernel_head_dim(in, in.params.shape, /*backward=*/false);
    return with_torch_errors([&] { return cuda::plan_forward(in.params, request); }).describe();
  }
  // As backward_cuda plans: the gemm family's rules see the operands as
  // given (grad_out as a contiguous tensor like q), the kernels' the padded ones.
  auto plan_params = [&] {
    const int64_t d = in.params.shape.head_dim;
    return backward_plan_params(in.params, {q.size(1) * q.size(2) * d, q.size(2) * d, d});
  };
  if (const auto gemm = with_torch_errors([&] { return cuda::plan_backward_gemm(plan_params(), request); }))
    return gemm->describe();
  pad_to_kernel_head_dim(in, in.params.shape, /*backward=*/true);
  return with_torch_errors([&] { return cuda::plan_backward(plan_params(), request); }).describe();
}

std::vector<int64_t> instantiated_head_dims(c10::string_view kernel) {
  return with_torch_errors([&] { return cuda::instantiated_head_dims(std::string(kernel)); });
}

std::vector<int64_t> served_head_dims(bool backward) {
  return with_torch_errors([&] { return cuda::served_head_dims(backward); });
}

// Seed 2: S = Q K^T (cuBLAS through ATen), one fused scale + mask + softmax
// kernel per row of S in place, then P V. Grouped-query heads are expanded.
at::Tensor naive_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask, bool is_causal,
                              std::optional<double> scale) {
  PreparedInputs in = prepare_forward("fusedattn.naive_forward", q, k, v, attn_mask, is_causal,
                                      scale, cuda_support());
  const c10::cuda::CUDAGuard guard(q.device());
  const AttentionShape& sh = in.params.shape;
  const at::Tensor k_full = in.k.repeat_interleave(sh.group_size(), 1);
  const at::Tensor v_full = in.v.repeat_interleave(sh.group_size(), 1);
  at::Tensor scores = at::matmul(in.q, k_full.transpose(-2, -1)).contiguous();

  cuda::SoftmaxRowsParams p;
  p.scores = scores.data_ptr();
  p.dtype = in.params.dtype;
  p.batch = sh.batch;
  p.heads = sh.heads_q;
  p.seqlen_q = sh.seqlen_q;
  p.seqlen_k = sh.seqlen_k;
  p.scale = in.params.scale;
  p.is_causal = is_causal;
  p.mask = in.params.mask;
  cuda::softmax_rows(p, stream_of(q));
  return at::matmul(scores, v_full);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("plan", &plan_cuda);
  m.impl("naive_forward", &naive_forward_cuda);
}

// No tensor argument to dispatch on: one kernel for every key.
TORCH_LIBRARY_IMPL(fusedattn, CompositeImplicitAutograd, m) {
  m.impl("instantiated_head_dims", &instantiated_head_dims);
  m.impl("served_head_dims", &served_head_dims);
}

}  // namespace fusedattn::ops
