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

#include "../cuda/common/mask_tiles.h"
#include "../cuda/naive/softmax_rows.h"
#include "../cuda/plan.h"
#include "../cuda/sm80/backward_sm80.h"
#include "../cuda/sm80/forward_sm80.h"
#include "../cuda/sm90/backward_sm90.h"
#include "../cuda/sm90/forward_sm90.h"
#include "checks.h"

namespace fusedattn::ops {
namespace {

// Any head dims d, d_v up to the largest the forward (or backward) serves:
// the kernels run them padded to kernel_head_dim. Soft-capping: the forward only.
const DeviceSupport& cuda_support(bool backward = false) {
  auto support = [](bool backward) {
    return DeviceSupport{"CUDA",          {at::kHalf, at::kBFloat16}, /*head_dims=*/{},
                         /*aligned_rows=*/true, /*own_value_head_dim=*/true, /*softcap=*/!backward,
                         /*sinks=*/true,  cuda::served_head_dims(backward).back()};
  };
  static const DeviceSupport forward = support(false), backward_support = support(true);
  return backward ? backward_support : forward;
}

// Pads `prepared` (PreparedInputs or PreparedBackward, of shape sh) to the
// head dim the forward's (or backward's) kernels run it at.
template <typename Prepared>
void pad_to_kernel_head_dim(Prepared& prepared, const AttentionShape sh, bool backward) {
  const int64_t head_dim =
      with_torch_errors([&] { return cuda::kernel_head_dim(sh.head_dim, sh.head_dim_v, backward); });
  if (head_dim != sh.head_dim || head_dim != sh.head_dim_v) pad_head_dims(prepared, head_dim);
}

PlanRequest family_request(const char* op, const std::optional<c10::string_view>& family, const at::Tensor& q) {
  PlanRequest r;
  r.family = parse_family(op, family, q);
  return r;
}

// Storage for the mask's tile lists as `layout` (mask_tiles.h) lays them out:
// the lists, the counts, the classes; the launch fills them.
at::Tensor mask_tiles_storage(MaskTiles& t, const MaskTiles& layout, const at::Tensor& like) {
  t = layout;
  const int64_t class_words = (cuda::mask_tiles_class_bytes(t) + 3) / 4;
  at::Tensor storage = at::empty({t.rows * (t.capacity + 1) + class_words}, like.options().dtype(at::kInt));
  t.lists = storage.data_ptr<int32_t>();
  t.counts = t.lists + t.rows * t.capacity;
  t.classes = reinterpret_cast<uint8_t*>(const_cast<int32_t*>(t.counts + t.rows));
  return storage;
}

void run_forward(ForwardParams& p, const Plan& plan, const at::Tensor& q, cudaStream_t stream) {
  at::Tensor mask_tiles;
  if (plan.mask_tiles)
    mask_tiles = mask_tiles_storage(p.mask.tiles, cuda::mask_tiles_layout(p, plan.block_m, plan.block_n), q);
  if (plan.family == Family::Sm90) {
    const at::Tensor work_counter = at::empty({1}, q.options().dtype(at::kInt));  // the launch zeroes it
    p.work_counter = reinterpret_cast<unsigned*>(work_counter.data_ptr<int>());
    cuda::forward_sm90(p, plan, stream);
  } else {
    cuda::forward_sm80(p, stream);
  }
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                                std::optional<double> scale,
                                                std::optional<c10::string_view> family,
                                                at::OptionalIntArrayRef window, std::optional<double> softcap,
                                                const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.forward";
  PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cuda_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());  // after the checks: q may be on the CPU
  const int64_t head_dim_v = in.params.shape.head_dim_v;
  pad_to_kernel_head_dim(in, in.params.shape, /*backward=*/false);
  auto [out, lse] = allocate_forward_outputs(in);
  const Plan plan = with_torch_errors([&] { return cuda::plan_forward(in.params, family_request(op, family, q)); });
  run_forward(in.params, plan, q, c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  return {unpadded(out, head_dim_v), lse};
}

// The backward's workspaces, as its plan needs them: delta always; the
// float32 dQ accumulator unless deterministic; the dK/dV sums of the query
// heads' splits when there are any; the mask's tile lists by key tiles.
struct BackwardWorkspaces {
  at::Tensor delta, grad_q_accum, grad_kv_accum, mask_tiles;
  BackwardWorkspaces(BackwardParams& p, const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& lse) {
    if (plan.mask_tiles)
      mask_tiles = mask_tiles_storage(p.fwd.mask.tiles, cuda::mask_tiles_layout_by_keys(p.fwd, plan.block_n,
                                                                                       plan.block_m), q);
    delta = at::empty(lse.sizes(), lse.options().dtype(at::kFloat));
    p.delta = delta.data_ptr<float>();
    if (!p.deterministic) {
      grad_q_accum = at::empty(q.sizes(), q.options().dtype(at::kFloat));
      p.grad_q_accum = grad_q_accum.data_ptr<float>();
    }
    p.head_splits = plan.head_splits;
    if (plan.head_splits > 1) {
      grad_kv_accum = at::empty({2, k.size(0), k.size(1), k.size(2), k.size(3)}, q.options().dtype(at::kFloat));
      p.grad_kv_accum = grad_kv_accum.data_ptr<float>();
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.backward";
  PreparedBackward b = prepare_backward(op, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale,
                                        cuda_support(/*backward=*/true), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  pad_to_kernel_head_dim(b, b.params.fwd.shape, /*backward=*/true);
  // torch.use_deterministic_algorithms(True): grad_q from its own pass, in a
  // fixed order, instead of float32 atomics.
  b.params.deterministic = at::globalContext().deterministicAlgorithms();
  const Plan plan = with_torch_errors([&] { return cuda::plan_backward(b.params, family_request(op, family, q)); });
  const BackwardWorkspaces workspaces(b.params, plan, b.fwd.q, b.fwd.k, lse);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  if (plan.family == Family::Sm90)
    cuda::backward_sm90(b.params, stream);
  else
    cuda::backward_sm80(b.params, stream);
  // The sinks' gradient from the delta the kernels computed.
  at::Tensor grad_sinks = sinks ? sinks_gradient(*sinks, b.lse, workspaces.delta)
                                : at::empty({0}, lse.options());
  return {unpadded(b.grad_q, q.size(3)), unpadded(b.grad_k, k.size(3)), unpadded(b.grad_v, v.size(3)), grad_sinks};
}

// The plan of forward (or backward) for these arguments. The backward's
// grad_out is contiguous (fusedattn's autograd makes it so) and its lse the
// forward's, so aligned stand-ins take their place; nothing is read.
std::string plan_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
                      std::optional<c10::string_view> family, bool backward, at::OptionalIntArrayRef window,
                      std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.plan";
  PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cuda_support(backward), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  pad_to_kernel_head_dim(in, in.params.shape, backward);
  const PlanRequest request = family_request(op, family, q);
  if (!backward) return with_torch_errors([&] { return cuda::plan_forward(in.params, request); }).describe();
  BackwardParams b;
  b.fwd = in.params;
  b.fwd.lse = reinterpret_cast<float*>(uintptr_t(256));
  b.grad_out = reinterpret_cast<const void*>(uintptr_t(256));
  const int64_t d = in.params.shape.head_dim;
  b.grad_out_strides = {q.size(1) * q.size(2) * d, q.size(2) * d, d};
  b.deterministic = at::globalContext().deterministicAlgorithms();
  return with_torch_errors([&] { return cuda::plan_backward(b, request); }).describe();
}

std::vector<int64_t> instantiated_head_dims(c10::string_view kernel) {
  return with_torch_errors([&] { return cuda::instantiated_head_dims(std::string(kernel)); });
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
  m.impl("plan", &plan_cuda);
  m.impl("naive_forward", &naive_forward_cuda);
}

// No tensor argument to dispatch on: one kernel for every key.
TORCH_LIBRARY_IMPL(fusedattn, CompositeImplicitAutograd, m) {
  m.impl("instantiated_head_dims", &instantiated_head_dims);
}

}  // namespace fusedattn::ops
