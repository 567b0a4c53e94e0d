// CPU kernels of the fusedattn operators.
#include <torch/library.h>

#include <string>

#include "../cpu/attention_cpu.h"
#include "checks.h"
#include "kvcache.h"

namespace fusedattn::ops {
namespace {

const DeviceSupport& cpu_support() {
  static const DeviceSupport support{"CPU", {at::kFloat, at::kHalf, at::kBFloat16}, {}};
  return support;
}

// The decode kernel's overrides mean nothing here; num_splits is checked
// and ignored, so that one call runs on either device.
void check_no_decode_overrides(const char* op, std::optional<int64_t> num_splits,
                               std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  decode_request(op, num_splits, std::nullopt, std::nullopt);
  TORCH_CHECK(!merge_in_cluster && !warps, op, ": merge_in_cluster and warps choose CUDA decode blocks; ",
              "pass None for CPU tensors");
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                               std::optional<double> scale,
                                               std::optional<c10::string_view> family) {
  const char* op = "fusedattn.forward";
  parse_family(op, family, q);
  PreparedInputs in = prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cpu_support());
  auto outputs = allocate_forward_outputs(in);
  cpu::forward(in.params);
  return outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family) {
  const char* op = "fusedattn.backward";
  parse_family(op, family, q);
  PreparedBackward b = prepare_backward(op, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, cpu_support());
  cpu::backward(b.params);
  return {b.grad_q, b.grad_k, b.grad_v};
}

std::tuple<at::Tensor, at::Tensor> forward_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, bool is_causal, std::optional<double> scale,
    std::optional<int64_t> num_splits, std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  const char* op = "fusedattn.forward_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  return forward_kvcache_by_sequence(
      q, k_cache, v_cache, cache_seqlens, k_new, v_new,
      [&](const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
          const at::Tensor& out_b, const at::Tensor& lse_b) {
        PreparedInputs in = prepare_forward(op, q_b, k_b, v_b, std::nullopt, is_causal, scale, cpu_support());
        set_forward_outputs(in.params, out_b, lse_b);
        cpu::forward(in.params);
      });
}

std::string plan_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
                     std::optional<c10::string_view> family, bool backward) {
  const char* op = "fusedattn.plan";
  parse_family(op, family, q);
  prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cpu_support());  // the call's checks
  return cpu::plan(backward).describe();
}

// The CPU runs forward_kvcache as one forward per sequence.
std::string plan_kvcache_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             bool is_causal, std::optional<double> scale, std::optional<int64_t> num_splits,
                             std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  const char* op = "fusedattn.plan_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  prepare_forward(op, q, k_cache, v_cache, std::nullopt, is_causal, scale, cpu_support());
  return cpu::plan(/*backward=*/false).describe();
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
  m.impl("forward_kvcache", &forward_kvcache_cpu);
  m.impl("plan", &plan_cpu);
  m.impl("plan_kvcache", &plan_kvcache_cpu);
}

}  // namespace fusedattn::ops
