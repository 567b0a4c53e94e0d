// CUDA kernels of the fusedattn operators: checks and parameters here, tiles
// in cpp/cuda. Launched on the current stream of the inputs' device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include <ATen/Context.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <string>

#include "../cuda/naive/softmax_rows.h"
#include "../cuda/sm80/backward_sm80.h"
#include "../cuda/sm80/forward_sm80.h"
#include "../cuda/sm90/backward_sm90.h"
#include "../cuda/sm90/forward_sm90.h"
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

// The kernel family for a call: sm90 (TMA, wgmma) where this build and the
// device have it and it takes the call, else sm80. FUSEDATTN_KERNEL_FAMILY=
// sm80 or sm90 forces one for forward and backward (for tests and benchmarks);
// forcing sm90 where it cannot run is an error.
std::string kernel_family() {
  const char* forced = std::getenv("FUSEDATTN_KERNEL_FAMILY");
  const std::string family = forced ? forced : "auto";
  TORCH_CHECK(family == "auto" || family == "sm80" || family == "sm90",
              "fusedattn: FUSEDATTN_KERNEL_FAMILY must be auto, sm80 or sm90, got '", family, "'");
  return family;
}

bool forced_family_is(const char* family) { return kernel_family() == family; }

// `takes`: whether the sm90 kernel serves this call; `refusal()` says what it
// serves, for the error when sm90 is forced on a call it does not take.
template <typename Refusal>
bool use_sm90(bool takes, Refusal refusal) {
  const std::string family = kernel_family();
  if (family == "sm80") return false;
  const bool available = cuda::sm90_available();
  if (family == "sm90") {
    TORCH_CHECK(available, "fusedattn: FUSEDATTN_KERNEL_FAMILY=sm90, but this build or device has no sm90 "
                "kernels (they need compute capability 9.0 and a build for 9.0a)");
    TORCH_CHECK(takes, "fusedattn: FUSEDATTN_KERNEL_FAMILY=sm90, but ", refusal());
  }
  return available && takes;
}

template <size_t N>
bool one_of(int64_t head_dim, const int (&dims)[N]) {
  return std::find(std::begin(dims), std::end(dims), head_dim) != std::end(dims);
}

// Without attn_mask the sm90 forward folds the scale into its exponent,
// which needs a scale of at least FLT_MIN: below it the kernels' fast math
// flushes the scale to 0, and 0 times a hidden score's -inf is NaN. Other
// scales take sm80, which scales before it masks.
bool use_sm90_forward(const ForwardParams& p) {
  const bool masked = p.mask.kind != MaskKind::None;
  const bool takes = one_of(p.shape.head_dim, cuda::kSm90HeadDims) &&
                     (!masked || p.shape.head_dim == cuda::kSm90MaskedHeadDim) &&
                     (masked || p.scale >= std::numeric_limits<float>::min());
  return use_sm90(takes, [&] {
    return c10::str("the sm90 forward takes head dims 64 and 128, attn_mask at head dim ",
                    cuda::kSm90MaskedHeadDim, " only, and without a mask a scale of at least ",
                    std::numeric_limits<float>::min(), "; got head dim ", p.shape.head_dim,
                    masked ? " with a mask" : c10::str(", scale ", p.scale));
  });
}

bool use_sm90_backward(const BackwardParams& p) {
  const bool takes = p.fwd.mask.kind == MaskKind::None && !p.deterministic &&
                     one_of(p.fwd.shape.head_dim, cuda::kSm90BackwardHeadDims);
  return use_sm90(takes, [&] {
    return "the sm90 backward takes no attn_mask, no deterministic mode and head dims 64 and 128 only; got head dim " +
           std::to_string(p.fwd.shape.head_dim) + (p.fwd.mask.kind != MaskKind::None ? " with a mask" : "") +
           (p.deterministic ? " in deterministic mode" : "");
  });
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const std::optional<at::Tensor>& attn_mask,
                                                bool is_causal, std::optional<double> scale) {
  PreparedInputs in =
      prepare_forward("fusedattn.forward", q, k, v, attn_mask, is_causal, scale, cuda_support());
  const c10::cuda::CUDAGuard guard(q.device());  // after the checks: q may be on the CPU
  auto outputs = allocate_forward_outputs(in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  // The sm90 kernel declines operands its tensor maps cannot describe (a
  // stride of 0, say); the sm80 kernel takes those.
  bool on_sm90 = false;
  if (use_sm90_forward(in.params)) {
    const at::Tensor work_counter = at::empty({1}, q.options().dtype(at::kInt));  // the launch zeroes it
    in.params.work_counter = reinterpret_cast<unsigned*>(work_counter.data_ptr<int>());
    on_sm90 = cuda::forward_sm90(in.params, stream);
  }
  if (!on_sm90) {
    TORCH_CHECK(!forced_family_is("sm90"), "fusedattn: FUSEDATTN_KERNEL_FAMILY=sm90, but the tensor memory "
                "accelerator cannot describe these q, k, v layouts (strides of 0 or not multiples of 16 bytes), or a "
                "sequence is longer than 2^30");
    cuda::forward_sm80(in.params, stream);
  }
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
  // The group's query heads split over blocks when a family's key blocks
  // alone would leave SMs idle; their float32 dK/dV sums need a workspace.
  at::Tensor grad_kv_accum;
  auto split_heads_for = [&](int keys_per_block, int blocks_per_sm) {
    b.params.head_splits = cuda::backward_head_splits(b.params, keys_per_block, blocks_per_sm);
    if (b.params.head_splits > 1 && !grad_kv_accum.defined()) {
      grad_kv_accum = at::empty({2, k.size(0), k.size(1), k.size(2), k.size(3)}, q.options().dtype(at::kFloat));
      b.params.grad_kv_accum = grad_kv_accum.data_ptr<float>();
    }
  };
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  if (use_sm90_backward(b.params)) {
    split_heads_for(cuda::kSm90BackwardBlockN, cuda::kSm90BackwardBlocksPerSm);
    if (cuda::backward_sm90(b.params, stream)) return {b.grad_q, b.grad_k, b.grad_v};
    // Declined: its tensor maps cannot describe the operands. sm80 takes them.
    TORCH_CHECK(!forced_family_is("sm90"), "fusedattn: FUSEDATTN_KERNEL_FAMILY=sm90, but the tensor memory "
                "accelerator cannot describe these q, k, v, grad_out layouts (strides of 0 or not multiples of 16 "
                "bytes), or the call is past its int coordinates (B x Hq x Nq or Nk of 2^31)");
  }
  split_heads_for(cuda::kBackwardBlockN, cuda::kBackwardBlocksPerSm);
  cuda::backward_sm80(b.params, stream);
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
