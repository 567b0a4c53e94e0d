// CPU kernels of the fusedattn operators.
#include <torch/library.h>

#include "../cpu/attention_cpu.h"
#include "checks.h"

namespace fusedattn::ops {
namespace {

const DeviceSupport& cpu_support() {
  static const DeviceSupport support{"CPU", {at::kFloat, at::kHalf, at::kBFloat16}, {}};
  return support;
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v,
                                               const std::optional<at::Tensor>& attn_mask,
                                               bool is_causal, std::optional<double> scale) {
  PreparedInputs in =
      prepare_forward("fusedattn.forward", q, k, v, attn_mask, is_causal, scale, cpu_support());
  auto outputs = allocate_forward_outputs(in);
  cpu::forward(in.params);
  return outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale) {
  PreparedBackward b = prepare_backward("fusedattn.backward", grad_out, q, k, v, out, lse,
                                        attn_mask, is_causal, scale, cpu_support());
  cpu::backward(b.params);
  return {b.grad_q, b.grad_k, b.grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
}

}  // namespace fusedattn::ops
