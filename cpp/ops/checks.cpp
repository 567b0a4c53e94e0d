#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "unfilled.h"

namespace fusedattn::ops {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

std::string dtype_list(const std::vector<at::ScalarType>& dtypes) {
  std::ostringstream s;
  for (size_t i = 0; i < dtypes.size(); ++i) s << (i ? ", " : "") << dtypes[i];
  return s.str();
}

void check_rank4(const char* op, const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be a 4-D tensor ", layout,
              ", got a tensor of shape ", shape_str(t));
}

// Converts attn_mask to a kind the kernels read and broadcasts it (stride 0,
// never materialised) to [B, Hq, Nq, Nk].
at::Tensor prepare_mask(const char* op, const at::Tensor& mask, const at::Tensor& q,
                        const at::Tensor& k, MaskParams& out) {
  const std::vector<int64_t> target{q.size(0), q.size(1), q.size(2), k.size(2)};
  TORCH_CHECK(mask.device() == q.device(), op, ": attn_mask must be on ", q.device(),
              " like q, got ", mask.device());
  bool broadcasts = mask.dim() <= 4;
  for (int64_t i = 1; broadcasts && i <= mask.dim(); ++i) {
    const int64_t size = mask.size(-i);
    broadcasts = size == 1 || size == target[4 - i];
  }
  TORCH_CHECK(broadcasts, op, ": attn_mask must broadcast to [B, Hq, Nq, Nk] = ",
              c10::IntArrayRef(target), ", got shape ", shape_str(mask));

  at::Tensor m = mask;
  if (m.scalar_type() == at::kBool) {
    out.kind = MaskKind::Bool;
  } else if (at::isFloatingType(m.scalar_type())) {
    if (m.scalar_type() == q.scalar_type() && q.scalar_type() != at::kFloat) {
      out.kind = MaskKind::AdditiveInput;
    } else {
      // Only the mask as given is converted, before broadcasting.
      m = m.to(at::kFloat);
      out.kind = MaskKind::AdditiveFloat32;
    }
  } else {
    TORCH_CHECK(false, op, ": attn_mask must be bool (True = may attend) or floating point "
                "(added to the scores), got ", m.scalar_type());
  }
  m = m.expand(target);
  out.ptr = m.data_ptr();
  out.batch_stride = m.stride(0);
  out.head_stride = m.stride(1);
  out.row_stride = m.stride(2);
  out.col_stride = m.stride(3);
  return m;
}

at::Tensor with_contiguous_rows(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: TORCH_CHECK(false, "fusedattn: no kernel dtype for ", t);
  }
}

at::Tensor as_kernel_operand(const at::Tensor& t, const DeviceSupport& support) {
  at::Tensor rows = with_contiguous_rows(t);
  if (!support.aligned_rows) return rows;
  const int64_t align = 16 / rows.element_size();
  const bool aligned = reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 &&
                       rows.stride(0) % align == 0 && rows.stride(1) % align == 0 &&
                       rows.stride(2) % align == 0;
  // A copy, not contiguous(): a contiguous view at an odd offset would come
  // back as itself, still off 16 bytes (the kernels' 16-byte loads fault there).
  return aligned ? rows : rows.clone(at::MemoryFormat::Contiguous);
}

TensorStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_output_layout(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q,
                         const at::Tensor& v) {
  const std::vector<int64_t> want{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(want), op, ": ", name, " must have the shape [B, Hq, Nq, d_v] = ",
              c10::IntArrayRef(want), " (q's, with v's head dim), got ", shape_str(t));
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have the dtype of q (",
              q.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on the device of q (", q.device(), "), got ",
              t.device());
}

void check_lse(const char* op, const at::Tensor& lse, const at::Tensor& q) {
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.size(2) == q.size(2),
              op, ": lse must have shape [B, Hq, Nq] = ", q.sizes().slice(0, 3), ", got ",
              shape_str(lse));
  TORCH_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32, got ",
              lse.scalar_type());
  TORCH_CHECK(lse.device() == q.device(), op, ": lse must be on ", q.device(), ", got ",
              lse.device());
}

void check_scale(const char* op, std::optional<double> scale) {
  // The kernels work in float32 with the scale times log2(e): a larger one
  // would be inf there and every output NaN.
  constexpr double kMaxScale = std::numeric_limits<float>::max() / 1.4426950408889634;  // log2(e)
  if (scale)
    TORCH_CHECK(std::isfinite(*scale) && std::abs(*scale) <= kMaxScale, op,
                ": scale must be finite and at most ", kMaxScale, " in magnitude, got ", *scale);
}

void check_window(const char* op, at::OptionalIntArrayRef window) {
  if (!window) return;
  const c10::IntArrayRef w = *window;
  TORCH_CHECK(w.size() == 2 && w[0] >= -1 && w[1] >= -1, op,
              ": window must be two ints [left, right], each >= -1 (-1: no bound on that side), got ", w);
}

void check_softcap_and_sinks(const char* op, const at::Tensor& q, std::optional<double> softcap,
                             const std::optional<at::Tensor>& sinks, const DeviceSupport& support) {
  if (softcap) {
    // The kernels divide by softcap * log2(e) in float32.
    constexpr double kMaxSoftcap = std::numeric_limits<float>::max() / 1.4426950408889634;
    // At least FLT_MIN: a smaller cap is 0 (or flushed to it) in the kernels' float32.
    constexpr double kMinSoftcap = std::numeric_limits<float>::min();
    TORCH_CHECK(std::isfinite(*softcap) && *softcap >= kMinSoftcap && *softcap <= kMaxSoftcap, op,
                ": softcap must be None or a finite number > 0 (from ", kMinSoftcap, " to ", kMaxSoftcap, "), got ",
                *softcap);
    TORCH_CHECK(support.softcap, op, ": on ", support.device_name,
                " this call does not soft-cap scores yet; dense attention (fusedattn.attention) does, on every device");
  }
  if (sinks) {
    const at::Tensor& s = *sinks;
    TORCH_CHECK(s.dim() == 1 && q.dim() >= 2 && s.size(0) == q.size(1), op,
                ": sinks must be a 1-D tensor of one logit per query head, [Hq] = [", q.dim() >= 2 ? q.size(1) : -1,
                "], got shape ", shape_str(s));
    TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": sinks must be float32, got ", s.scalar_type());
    TORCH_CHECK(s.device() == q.device(), op, ": sinks must be on ", q.device(), " like q, got ", s.device());
    TORCH_CHECK(support.sinks, op, ": on ", support.device_name, " fusedattn does not take attention sinks yet");
  }
}

at::Tensor sinks_gradient(const std::optional<at::Tensor>& given, const at::Tensor& lse, const at::Tensor& delta) {
  if (!given) return empty_unfilled({0}, lse.options());
  const at::Tensor& sinks = *given;
  TORCH_INTERNAL_ASSERT(lse.sizes() == delta.sizes() && lse.dim() >= 2 && lse.size(1) == sinks.size(0));
  std::vector<int64_t> shape(lse.dim(), 1);
  shape[1] = sinks.size(0);
  const at::Tensor sink_mass = at::where(lse == -std::numeric_limits<float>::infinity(), at::zeros({}, lse.options()),
                                         at::exp(sinks.view(shape) - lse));
  std::vector<int64_t> others{0};
  for (int64_t i = 2; i < lse.dim(); ++i) others.push_back(i);
  return -(sink_mass * delta).sum(others);
}

at::Tensor sinks_gradient_from_output(const std::optional<at::Tensor>& sinks, const at::Tensor& lse,
                                      const at::Tensor& grad_out, const at::Tensor& out) {
  return sinks ? sinks_gradient(sinks, lse, output_delta(grad_out, out)) : empty_unfilled({0}, lse.options());
}

at::Tensor output_delta(const at::Tensor& grad_out, const at::Tensor& out) {
  return (grad_out.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
}

namespace {

// in.params' q, k and v pointers and strides from in's tensors.
void point_operands(PreparedInputs& in) {
  ForwardParams& p = in.params;
  p.q = in.q.data_ptr();
  p.k = in.k.data_ptr();
  p.v = in.v.data_ptr();
  p.q_strides = strides_of(in.q);
  p.k_strides = strides_of(in.k);
  p.v_strides = strides_of(in.v);
}

}  // namespace

void apply_window(const char* op, ForwardParams& p, at::OptionalIntArrayRef window) {
  check_window(op, window);
  if (!window) return;
  // A side wider than Nq + Nk bounds nothing; capped, the kernels' position
  // arithmetic cannot overflow.
  const int64_t widest = p.shape.seqlen_q + p.shape.seqlen_k;
  p.window_left = std::min((*window)[0], widest);
  // The right side at 0 is the causal rule; under it, any right side is.
  if ((*window)[1] == 0) p.is_causal = true;
  p.window_right = p.is_causal ? -1 : std::min((*window)[1], widest);
}

PreparedInputs prepare_forward(const char* op, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                               bool is_causal, std::optional<double> scale,
                               const DeviceSupport& support, at::OptionalIntArrayRef window,
                               std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  check_rank4(op, q, "q", "[B, Hq, Nq, d]");
  check_rank4(op, k, "k", "[B, Hkv, Nk, d]");
  check_rank4(op, v, "v", "[B, Hkv, Nk, d_v]");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), op,
              ": q, k and v must be on one device, got q on ", q.device(), ", k on ", k.device(),
              ", v on ", v.device());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k and v must have one dtype, got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(k.sizes().slice(0, 3) == v.sizes().slice(0, 3), op,
              ": k and v must have the same [B, Hkv, Nk], got k ", shape_str(k), " and v ", shape_str(v));
  TORCH_CHECK(q.size(0) == k.size(0), op, ": q and k must have the same batch size, got q ",
              shape_str(q), " and k ", shape_str(k));
  TORCH_CHECK(q.size(3) == k.size(3), op, ": q and k must have the same head dim d, got q ",
              shape_str(q), " and k ", shape_str(k));
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
              ": the number of query heads Hq must be a multiple of the number of key/value "
              "heads Hkv, got Hq = ", q.size(1), " and Hkv = ", k.size(1));
  TORCH_CHECK(q.size(3) > 0, op, ": head dim d must be at least 1, got q ", shape_str(q));
  TORCH_CHECK(v.size(3) > 0, op, ": v's head dim d_v must be at least 1, got v ", shape_str(v));
  TORCH_CHECK(support.own_value_head_dim || v.size(3) == q.size(3), op, ": on ", support.device_name,
              " v must have the head dim of q and k (d = ", q.size(3), "), got v ", shape_str(v),
              "; a value head dim of its own runs on the CPU");

  const auto& dtypes = support.dtypes;
  TORCH_CHECK(std::find(dtypes.begin(), dtypes.end(), q.scalar_type()) != dtypes.end(), op,
              ": on ", support.device_name, " q, k and v must be one of ", dtype_list(dtypes),
              "; got ", q.scalar_type());
  const auto& dims = support.head_dims;
  TORCH_CHECK(dims.empty() || std::find(dims.begin(), dims.end(), q.size(3)) != dims.end(), op,
              ": on ", support.device_name, " the head dim must be one of ",
              c10::IntArrayRef(dims), "; got ", q.size(3));
  TORCH_CHECK(support.max_head_dim == 0 || std::max(q.size(3), v.size(3)) <= support.max_head_dim, op, ": on ",
              support.device_name, " the head dims d and d_v must be at most ", support.max_head_dim, ", got q ",
              shape_str(q), " and v ", shape_str(v));
  check_scale(op, scale);

  check_softcap_and_sinks(op, q, softcap, sinks, support);

  PreparedInputs in;
  in.q = as_kernel_operand(q, support);
  in.k = as_kernel_operand(k, support);
  in.v = as_kernel_operand(v, support);
  ForwardParams& p = in.params;
  p.shape = {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  p.dtype = dtype_of(q.scalar_type());
  point_operands(in);
  p.scale = static_cast<float>(scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3))));
  p.is_causal = is_causal;
  apply_window(op, p, window);
  if (attn_mask) in.mask = prepare_mask(op, *attn_mask, q, k, p.mask);
  if (softcap) p.softcap = static_cast<float>(*softcap);
  if (sinks) {
    in.sinks = sinks->contiguous();
    p.sinks = in.sinks.data_ptr<float>();
  }
  return in;
}

std::tuple<at::Tensor, at::Tensor> allocate_forward_outputs(PreparedInputs& in) {
  const AttentionShape& sh = in.params.shape;
  at::Tensor out = empty_unfilled({sh.batch, sh.heads_q, sh.seqlen_q, sh.head_dim_v}, in.q.options());
  at::Tensor lse = empty_unfilled({sh.batch, sh.heads_q, sh.seqlen_q}, in.q.options().dtype(at::kFloat));
  set_forward_outputs(in.params, out, lse);
  return {out, lse};
}

void set_forward_outputs(ForwardParams& params, const at::Tensor& out, const at::Tensor& lse) {
  params.out = out.data_ptr();
  params.out_strides = strides_of(out);
  params.lse = lse.data_ptr<float>();
}

namespace {

// t zero-padded in its last dimension to head_dim columns (a contiguous copy), or t.
at::Tensor padded_to(const at::Tensor& t, int64_t head_dim) {
  if (t.size(-1) == head_dim) return t;
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = head_dim;
  at::Tensor padded = at::zeros(shape, t.options());
  padded.narrow(-1, 0, t.size(-1)).copy_(t);
  return padded;
}

// b.params from b's tensors.
void point_backward_params(PreparedBackward& b) {
  BackwardParams& p = b.params;
  p.fwd = b.fwd.params;
  p.fwd.out = b.out.data_ptr();
  p.fwd.out_strides = strides_of(b.out);
  p.fwd.lse = b.lse.data_ptr<float>();  // only read by the backward
  p.grad_out = b.grad_out.data_ptr();
  p.grad_q = b.grad_q.data_ptr();
  p.grad_k = b.grad_k.data_ptr();
  p.grad_v = b.grad_v.data_ptr();
  p.grad_out_strides = strides_of(b.grad_out);
  p.grad_q_strides = strides_of(b.grad_q);
  p.grad_k_strides = strides_of(b.grad_k);
  p.grad_v_strides = strides_of(b.grad_v);
}

}  // namespace

PreparedBackward prepare_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
                                  bool is_causal, std::optional<double> scale,
                                  const DeviceSupport& support, at::OptionalIntArrayRef window,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  PreparedBackward b;
  b.fwd = prepare_forward(op, q, k, v, attn_mask, is_causal, scale, support, window, softcap, sinks);
  check_output_layout(op, grad_out, "grad_out", q, v);
  check_output_layout(op, out, "out", q, v);
  check_lse(op, lse, q);

  b.grad_out = as_kernel_operand(grad_out, support);
  b.out = as_kernel_operand(out, support);
  b.lse = lse.contiguous();
  b.grad_q = empty_unfilled(q.sizes(), q.options());
  b.grad_k = empty_unfilled(k.sizes(), k.options());
  b.grad_v = empty_unfilled(v.sizes(), v.options());
  point_backward_params(b);
  return b;
}

void pad_head_dims(PreparedInputs& in, int64_t head_dim) {
  ForwardParams& p = in.params;
  in.q = padded_to(in.q, head_dim);
  in.k = padded_to(in.k, head_dim);
  in.v = padded_to(in.v, head_dim);
  p.shape.head_dim = p.shape.head_dim_v = head_dim;
  point_operands(in);
}

void pad_head_dims(PreparedBackward& b, int64_t head_dim) {
  pad_head_dims(b.fwd, head_dim);
  b.grad_out = padded_to(b.grad_out, head_dim);
  b.out = padded_to(b.out, head_dim);
  use_gradients(b, [](const at::Tensor& like) { return empty_unfilled(like.sizes(), like.options()); });
}

void use_gradients(PreparedBackward& b, const std::function<at::Tensor(const at::Tensor&)>& allocate) {
  // The unused gradients go first, so that the allocator can hand their
  // memory to the new ones instead of holding both at once.
  b.grad_q = b.grad_k = b.grad_v = at::Tensor();
  b.grad_q = allocate(b.fwd.q);
  b.grad_k = allocate(b.fwd.k);
  b.grad_v = allocate(b.fwd.v);
  point_backward_params(b);
}

at::Tensor unpadded(const at::Tensor& t, int64_t head_dim) {
  return t.size(-1) == head_dim ? t : t.narrow(-1, 0, head_dim).contiguous();
}

PlanRequest::FamilyChoice parse_family(const char* op, const std::optional<c10::string_view>& family,
                                       const at::Tensor& q) {
  using Choice = PlanRequest::FamilyChoice;
  const std::string name = family ? std::string(*family) : "auto";
  if (name == "auto") return Choice::Auto;
  if (name == "gemm") return Choice::Gemm;
  if (q.is_cuda()) {
    if (name == "sm80") return Choice::Sm80;
    if (name == "sm90") return Choice::Sm90;
    TORCH_CHECK(false, op, ": family must be None, 'auto', 'sm80', 'sm90' or 'gemm' for CUDA tensors, got '", name,
                "'");
  }
  TORCH_CHECK(name == "cpu", op, ": family must be None, 'auto', 'cpu' or 'gemm' for ", q.device().type(),
              " tensors, got '", name, "'");
  return Choice::Auto;
}

PlanRequest decode_request(const char* op, std::optional<int64_t> num_splits,
                           std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  PlanRequest r;
  if (num_splits) {
    TORCH_CHECK(*num_splits >= 1 && *num_splits <= kMaxDecodeSplits, op, ": num_splits must be None or in [1, ",
                kMaxDecodeSplits, "], got ", *num_splits);
    r.num_splits = static_cast<int>(*num_splits);
  }
  if (merge_in_cluster) r.merge_in_cluster = *merge_in_cluster ? 1 : 0;
  if (warps) {
    TORCH_CHECK(*warps == 4 || *warps == 8, op, ": warps must be None, 4 or 8, got ", *warps);
    r.warps = static_cast<int>(*warps);
  }
  return r;
}

}  // namespace fusedattn::ops
