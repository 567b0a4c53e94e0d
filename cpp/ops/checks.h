// Input validation and parameter filling shared by every device's operators.
// Every failure says what was expected and what was given.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::ops {

// What one device's kernels accept.
struct DeviceSupport {
  std::string device_name;               // "CPU", "CUDA"
  std::vector<at::ScalarType> dtypes;    // accepted q/k/v dtypes
  std::vector<int64_t> head_dims;        // empty: any head dim >= 1
  bool aligned_rows = false;             // rows must start on 16-byte boundaries (vector loads)
  bool own_value_head_dim = false;       // v's head dim may differ from q's and k's
  bool softcap = false;                  // the kernels soft-cap scores
  bool sinks = false;                    // the kernels take attention sinks
  int64_t max_head_dim = 0;              // d and d_v at most this (0: no bound), where head_dims is empty
};

// q, k, v (and the mask) as the kernels will read them, with the tensors that
// own their memory kept alive.
struct PreparedInputs {
  at::Tensor q, k, v, mask, sinks;
  ForwardParams params;  // everything but out and lse
};

// window: the operator's argument ([left, right], each >= -1), folded into
// is_causal where it means the causal rule (a right side of 0, or any right
// side under is_causal). softcap and sinks: as check_softcap_and_sinks takes them.
PreparedInputs prepare_forward(const char* op, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                               bool is_causal, std::optional<double> scale,
                               const DeviceSupport& support, at::OptionalIntArrayRef window = std::nullopt,
                               std::optional<double> softcap = std::nullopt,
                               const std::optional<at::Tensor>& sinks = std::nullopt);

// softcap None or finite and > 0; sinks None or float32 [Hq] (q's heads) on
// q's device; each refused where the device's kernels do not take it. For
// calls that must refuse them before they write anything, as check_window.
void check_softcap_and_sinks(const char* op, const at::Tensor& q, std::optional<double> softcap,
                             const std::optional<at::Tensor>& sinks, const DeviceSupport& support);

// The gradient of the sinks, float32 [Hq]: d sink_h = -sum over h's rows of
// exp(sink_h - lse) * delta, where delta = rowsum(grad_out * out) and lse
// includes the sink (rows of lse = -inf, which see nothing, add 0). lse and
// delta have the same shape with the head as dimension 1 ([B, Hq, Nq], or
// varlen's [total_q, Hq]). Without sinks, an empty float32 tensor.
at::Tensor sinks_gradient(const std::optional<at::Tensor>& sinks, const at::Tensor& lse, const at::Tensor& delta);
// The same from grad_out and out, where the kernels keep their delta to
// themselves (computed only with sinks).
at::Tensor sinks_gradient_from_output(const std::optional<at::Tensor>& sinks, const at::Tensor& lse,
                                      const at::Tensor& grad_out, const at::Tensor& out);

// delta = rowsum(grad_out * out) in float32.
at::Tensor output_delta(const at::Tensor& grad_out, const at::Tensor& out);

// prepare_forward's check of `window` alone, for calls that must refuse a
// bad window before they write anything.
void check_window(const char* op, at::OptionalIntArrayRef window);

// p's window from the operator's argument (checked) and p.shape (a side
// capped at Nq + Nk), is_causal folded in: prepare_forward's, again for a
// caller that changes the shape it saw.
void apply_window(const char* op, ForwardParams& p, at::OptionalIntArrayRef window);

// prepare_forward's check of `scale` alone (finite, within float32 once
// multiplied by log2(e)), likewise.
void check_scale(const char* op, std::optional<double> scale);

// The last dimension made contiguous (copying if it is not), other strides
// kept; where the device needs it, also a copy when the data or a stride is not
// a multiple of 16 bytes.
at::Tensor as_kernel_operand(const at::Tensor& t, const DeviceSupport& support);

TensorStrides strides_of(const at::Tensor& t);

// The kernels' DType of a float32, float16 or bfloat16 tensor (an error otherwise).
DType dtype_of(at::ScalarType t);

// Checks that `t` (named `name` in the message) is an output-shaped tensor,
// [B, Hq, Nq, d_v] from q and v, with q's dtype and device.
void check_output_layout(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q,
                         const at::Tensor& v);

// Checks that lse is float32 [B, Hq, Nq] on q's device.
void check_lse(const char* op, const at::Tensor& lse, const at::Tensor& q);

struct PreparedBackward {
  PreparedInputs fwd;
  at::Tensor grad_out, out, lse, grad_q, grad_k, grad_v;
  BackwardParams params;
};

// Validates the backward's inputs and allocates grad_q, grad_k, grad_v
// (contiguous, the dtype of q). lse is read as written by the forward.
PreparedBackward prepare_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                                  bool is_causal, std::optional<double> scale,
                                  const DeviceSupport& support, at::OptionalIntArrayRef window = std::nullopt,
                                  std::optional<double> softcap = std::nullopt,
                                  const std::optional<at::Tensor>& sinks = std::nullopt);

// in's q, k and v zero-padded in their last dimension to head_dim, d and d_v
// alike, and params following (shape, pointers, strides; the scale stays the
// call's): for kernels instantiated at fewer head dims than the calls they
// serve. The zero columns add nothing to Q K^T and give zero columns of out
// (and of grad_q, grad_k and grad_v), which the operators cut off.
void pad_head_dims(PreparedInputs& in, int64_t head_dim);
// The same for a backward: q, k, v, grad_out and out padded, and grad_q,
// grad_k and grad_v allocated at the padded head dim.
void pad_head_dims(PreparedBackward& b, int64_t head_dim);

// b.grad_q, grad_k and grad_v replaced by allocate(b.fwd.q), (.k), (.v)
// (the kernels' views of gradients laid out otherwise), the params following;
// the old ones are dropped first.
void use_gradients(PreparedBackward& b, const std::function<at::Tensor(const at::Tensor&)>& allocate);

// t's first `head_dim` columns (its last dimension), contiguous: a padded
// output cut back to the call's head dim (t itself where nothing was padded).
at::Tensor unpadded(const at::Tensor& t, int64_t head_dim);

// Points params at out ([B, Hq, Nq, d], last dim contiguous) and lse
// (contiguous float32 [B, Hq, Nq]).
void set_forward_outputs(ForwardParams& params, const at::Tensor& out, const at::Tensor& lse);

// Allocates out (q's dtype) and lse (float32 [B, Hq, Nq]) and points params at them.
std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(PreparedInputs& in);

// f(), with host code's std::invalid_argument (the planner's: a forced
// choice that cannot serve the call) turned into a torch error.
template <typename F>
auto with_torch_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

// The operators' `family` argument: None or "auto" leaves the family to the
// planner; on CUDA tensors "sm80" or "sm90" force one, on CPU tensors "cpu"
// names the tiled kernels; "gemm" (cpp/ops/gemm_attention.h) on either.
// Anything else is an error naming what q's device takes.
PlanRequest::FamilyChoice parse_family(const char* op, const std::optional<c10::string_view>& family,
                                       const at::Tensor& q);

// The decode operators' overrides: num_splits None or in [1,
// kMaxDecodeSplits], merge_in_cluster None/False/True, warps None, 4 or 8.
PlanRequest decode_request(const char* op, std::optional<int64_t> num_splits,
                           std::optional<bool> merge_in_cluster, std::optional<int64_t> warps);

}  // namespace fusedattn::ops
