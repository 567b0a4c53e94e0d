#include "operators_cuda.h"

#include <c10/cuda/CUDAStream.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "../cuda/common/mask_tiles.h"
#include "../cuda/sm80/backward_sm80.h"
#include "../cuda/sm80/forward_sm80.h"
#include "../cuda/sm90/backward_sm90.h"
#include "../cuda/sm90/forward_sm90.h"
#include "unfilled.h"

namespace fusedattn::ops {
namespace {

// Storage for the mask's tile lists as `layout` (mask_tiles.h) lays them out:
// the lists, the counts, the classes; the launch fills them.
at::Tensor mask_tiles_storage(MaskTiles& t, const MaskTiles& layout, const at::Tensor& like) {
  t = layout;
  const int64_t class_words = (cuda::mask_tiles_class_bytes(t) + 3) / 4;
  at::Tensor storage = empty_unfilled({t.rows * (t.capacity + 1) + class_words}, like.options().dtype(at::kInt));
  t.lists = storage.data_ptr<int32_t>();
  t.counts = t.lists + t.rows * t.capacity;
  t.classes = reinterpret_cast<uint8_t*>(const_cast<int32_t*>(t.counts + t.rows));
  return storage;
}

}  // namespace

const DeviceSupport& cuda_support(bool backward) {
  auto support = [](bool backward) {
    return DeviceSupport{"CUDA",          {at::kHalf, at::kBFloat16}, /*head_dims=*/{},
                         /*aligned_rows=*/true, /*own_value_head_dim=*/true, /*softcap=*/true,
                         /*sinks=*/true,  cuda::served_head_dims(backward).back()};
  };
  static const DeviceSupport forward = support(false), backward_support = support(true);
  return backward ? backward_support : forward;
}

const DeviceSupport& cuda_dense_support() {
  static const DeviceSupport support{"CUDA",          {at::kFloat, at::kHalf, at::kBFloat16}, /*head_dims=*/{},
                                     /*aligned_rows=*/true, /*own_value_head_dim=*/true, /*softcap=*/true,
                                     /*sinks=*/true};
  return support;
}

PlanRequest family_request(const char* op, const std::optional<c10::string_view>& family, const at::Tensor& q) {
  PlanRequest r;
  r.family = parse_family(op, family, q);
  r.deterministic = at::globalContext().deterministicAlgorithms();
  return r;
}

cudaStream_t stream_of(const at::Tensor& q) { return c10::cuda::getCurrentCUDAStream(q.device().index()).stream(); }

void run_forward(ForwardParams& p, const Plan& plan, const at::Tensor& q, cudaStream_t stream) {
  at::Tensor mask_tiles;
  if (plan.mask_tiles)
    mask_tiles = mask_tiles_storage(p.mask.tiles, cuda::mask_tiles_layout(p, plan.block_m, plan.block_n), q);
  if (plan.family == Family::Sm90) {
    const at::Tensor work_counter = empty_unfilled({1}, q.options().dtype(at::kInt));  // the launch zeroes it
    p.work_counter = reinterpret_cast<unsigned*>(work_counter.data_ptr<int>());
    cuda::forward_sm90(p, plan, stream);
  } else if (plan.family == Family::Sm80) {
    cuda::forward_sm80(p, plan, stream);
  } else {
    throw_planner_bug(std::string("run_forward runs the sm80 and sm90 families, not ") + family_name(plan.family));
  }
}

BackwardWorkspaces::BackwardWorkspaces(BackwardParams& p, const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& lse) {
  if (plan.mask_tiles)
    mask_tiles =
        mask_tiles_storage(p.fwd.mask.tiles, cuda::mask_tiles_layout_by_keys(p.fwd, plan.block_n, plan.block_m), q);
  delta = empty_unfilled(lse.sizes(), lse.options().dtype(at::kFloat));
  p.delta = delta.data_ptr<float>();
  if (!p.deterministic || plan.ordered_dq()) {
    grad_q_accum = empty_unfilled(q.sizes(), q.options().dtype(at::kFloat));
    p.grad_q_accum = grad_q_accum.data_ptr<float>();
  }
  if (plan.ordered_dq()) {
    dq_turns = empty_unfilled({cuda::sm90_backward_dq_turns(p.fwd, plan)}, q.options().dtype(at::kInt));
    p.dq_turns = dq_turns.data_ptr<int>();
  }
  p.head_splits = plan.head_splits;
  if (plan.head_splits > 1) {
    grad_kv_accum = empty_unfilled({2, k.size(0), k.size(1), k.size(2), k.size(3)}, q.options().dtype(at::kFloat));
    p.grad_kv_accum = grad_kv_accum.data_ptr<float>();
  }
}

BackwardParams backward_plan_params(const ForwardParams& fwd, const TensorStrides& grad_out_strides) {
  BackwardParams b;
  b.fwd = fwd;
  b.fwd.lse = reinterpret_cast<float*>(uintptr_t(256));
  b.grad_out = reinterpret_cast<const void*>(uintptr_t(256));
  b.grad_out_strides = grad_out_strides;
  b.deterministic = at::globalContext().deterministicAlgorithms();
  return b;
}

void run_backward(const BackwardParams& p, const Plan& plan, cudaStream_t stream) {
  if (plan.family == Family::Sm90)
    cuda::backward_sm90(p, plan, stream);
  else if (plan.family == Family::Sm80)
    cuda::backward_sm80(p, plan, stream);
  else
    throw_planner_bug(std::string("run_backward runs the sm80 and sm90 families, not ") + family_name(plan.family));
}

}  // namespace fusedattn::ops
