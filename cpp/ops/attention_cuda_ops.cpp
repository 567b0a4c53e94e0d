// CUDA kernels of the fusedattn operators: checks and parameters here, tiles
// in cpp/cuda. Launched on the current stream of the inputs' device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CUDA, m) { m.impl("forward", &forward_cuda); }

}  // namespace fusedattn::ops
