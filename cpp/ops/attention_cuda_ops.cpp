// CUDA kernels of the fusedattn operators: checks and parameters here, tiles
// in cpp/cuda. Launched on the current stream of the inputs' device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include <ATen/Context.h>

#include "../cuda/naive/softmax_rows.h"
#include "../cuda/sm80/backward_sm80.h"
#include "../cuda/sm80/forward_sm80.h"
#include "checks.h"

namespace fusedattn::ops {
namespace {

const DeviceSupport& cuda_support() {
  static const DeviceSupport support{
      "CUDA",
      {at::kHalf, at::kBFloat16},
      std::vector<int64_t>(std::begin(cuda::kSm80HeadDims), std::end(cuda::kSm80HeadDims)),
      /*aligned_rows=*/true};
  return support;
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const std::optional<at::Tensor>& attn_mask,
                                                bool is_causal, std::optional<double> scale) {
  PreparedInputs in =
      prepare_forward("fusedattn.forward", q, k, v, attn_mask, is_causal, scale, cuda_support());
  const c10::cuda::CUDAGuard guard(q.device());  // after the checks: q may be on the CPU
  auto outputs = allocate_forward_outputs(in);
  cuda::forward_sm80(in.params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale) {
  PreparedBackward b = prepare_backward("fusedattn.backward", grad_out, q, k, v, out, lse, attn_mask,
                                        is_causal, scale, cuda_support());
  const c10::cuda::CUDAGuard guard(q.device());
  // torch.use_deterministic_algorithms(True): grad_q from its own pass, in a
  // fixed order, instead of float32 atomics.
  b.params.deterministic = at::globalContext().deterministicAlgorithms();
  const at::Tensor delta = at::empty(lse.sizes(), lse.options().dtype(at::kFloat));
  at::Tensor grad_q_accum;
  if (!b.params.deterministic) {
    grad_q_accum = at::empty(q.sizes(), q.options().dtype(at::kFloat));
    b.params.grad_q_accum = grad_q_accum.data_ptr<float>();
  }
  b.params.delta = delta.data_ptr<float>();
  b.params.head_splits = cuda::backward_head_splits(b.params);
  at::Tensor grad_kv_accum;
  if (b.params.head_splits > 1) {
    grad_kv_accum = at::empty({2, k.size(0), k.size(1), k.size(2), k.size(3)}, q.options().dtype(at::kFloat));
    b.params.grad_kv_accum = grad_kv_accum.data_ptr<float>();
  }
  cuda::backward_sm80(b.params, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {b.grad_q, b.grad_k, b.grad_v};
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
  cuda::softmax_rows(p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return at::matmul(scores, v_full);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("naive_forward", &naive_forward_cuda);
}

}  // namespace fusedattn::ops
