// CPU kernels of the fusedattn operators.
#include <torch/library.h>

#include "../cpu/attention_cpu.h"
#include "checks.h"
#include "kvcache.h"

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

std::tuple<at::Tensor, at::Tensor> forward_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, bool is_causal, std::optional<double> scale) {
  return forward_kvcache_by_sequence(
      q, k_cache, v_cache, cache_seqlens, k_new, v_new,
      [&](const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
          const at::Tensor& out_b, const at::Tensor& lse_b) {
        PreparedInputs in = prepare_forward("fusedattn.forward_kvcache", q_b, k_b, v_b,
                                            std::nullopt, is_causal, scale, cpu_support());
        set_forward_outputs(in.params, out_b, lse_b);
        cpu::forward(in.params);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
  m.impl("forward_kvcache", &forward_kvcache_cpu);
}

}  // namespace fusedattn::ops
