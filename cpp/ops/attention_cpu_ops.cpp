// CPU kernels of the fusedattn operators.
#include <torch/library.h>

#include <ATen/ATen.h>

#include <string>

#include "../cpu/attention_cpu.h"
#include "checks.h"
#include "gemm_attention.h"
#include "kvcache.h"
#include "paged_cache.h"
#include "unfilled.h"
#include "varlen.h"

namespace fusedattn::ops {
namespace {

const DeviceSupport& cpu_support() {
  static const DeviceSupport support{"CPU", {at::kFloat, at::kHalf, at::kBFloat16}, {}, /*aligned_rows=*/false,
                                     /*own_value_head_dim=*/true, /*softcap=*/true, /*sinks=*/true};
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
                                               std::optional<c10::string_view> family,
                                               at::OptionalIntArrayRef window, std::optional<double> softcap,
                                               const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.forward";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cpu_support(), window, softcap, sinks);
  auto outputs = allocate_forward_outputs(in);
  if (gemm)
    gemm_forward(in, cpu::plan_gemm(in.params, /*backward=*/false), std::get<0>(outputs), std::get<1>(outputs));
  else
    cpu::forward(in.params);
  return outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.backward";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  PreparedBackward b = prepare_backward(op, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, cpu_support(),
                                        window, softcap, sinks);
  if (gemm) {
    const at::Tensor delta = gemm_backward(b, cpu::plan_gemm(b.params.fwd, /*backward=*/true));
    return {b.grad_q, b.grad_k, b.grad_v, sinks_gradient(sinks, lse, delta)};
  }
  cpu::backward(b.params);
  return {b.grad_q, b.grad_k, b.grad_v, sinks_gradient_from_output(sinks, lse, grad_out, out)};
}

std::tuple<at::Tensor, at::Tensor> forward_kvcache_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, bool is_causal, std::optional<double> scale,
    std::optional<int64_t> num_splits, std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& block_table) {
  const char* op = "fusedattn.forward_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  check_window(op, window);  // before any sequence's keys are appended
  check_scale(op, scale);
  check_softcap_and_sinks(op, q, softcap, sinks, cpu_support());
  const SequenceForward forward = [&](const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
                                      const at::Tensor& out_b, const at::Tensor& lse_b) {
    PreparedInputs in =
        prepare_forward(op, q_b, k_b, v_b, std::nullopt, is_causal, scale, cpu_support(), window, softcap, sinks);
    set_forward_outputs(in.params, out_b, lse_b);
    cpu::forward(in.params);
  };
  return forward_kvcache_each_sequence(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new,
                                       block_table, forward);
}

// The kernels' view of a packed call's sequences (host cu_seqlens, which `lengths` holds).
VarlenParams host_varlen(const VarlenLengths& lengths) {
  VarlenParams v;
  v.cu_seqlens_q = lengths.cu_q.data_ptr<int32_t>();
  v.cu_seqlens_k = lengths.cu_k.data_ptr<int32_t>();
  v.batch = lengths.batch;
  return v;
}

// Packed sequences: the tiled kernels take the whole batch as one [1, H,
// total, d] call whose tasks each lie in one sequence (cpu/sequences.h); the
// gemm family, where forced, runs one dense problem per sequence. lse is
// [Hq, total_q].
std::tuple<at::Tensor, at::Tensor> forward_varlen_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                      int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                                      std::optional<double> scale,
                                                      std::optional<c10::string_view> family,
                                                      at::OptionalIntArrayRef window, std::optional<double> softcap,
                                                      const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.forward_varlen";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  check_window(op, window);  // also when no sequence has queries
  check_softcap_and_sinks(op, q, softcap, sinks, cpu_support());
  const VarlenLengths lengths =
      check_varlen_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  if (gemm)
    return forward_by_sequence(q, k, v, lengths, [&](const at::Tensor& q_b, const at::Tensor& k_b,
                                                     const at::Tensor& v_b, const at::Tensor& out_b,
                                                     const at::Tensor& lse_b) {
      PreparedInputs in =
          prepare_forward(op, q_b, k_b, v_b, std::nullopt, is_causal, scale, cpu_support(), window, softcap, sinks);
      gemm_forward(in, cpu::plan_gemm(in.params, /*backward=*/false), out_b, lse_b);
    });
  PreparedInputs in = prepare_forward(op, as_one_batch(q), as_one_batch(k), as_one_batch(v), std::nullopt, is_causal,
                                      scale, cpu_support(), window, softcap, sinks);
  at::Tensor out = empty_unfilled({q.size(0), q.size(1), v.size(2)}, q.options());
  at::Tensor lse = empty_unfilled({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  set_forward_outputs(in.params, as_one_batch(out), lse.unsqueeze(0));
  in.params.varlen = host_varlen(lengths);
  cpu::forward(in.params);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_varlen_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.backward_varlen";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  check_window(op, window);
  check_softcap_and_sinks(op, q, softcap, sinks, cpu_support());
  const VarlenLengths lengths =
      check_varlen_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_varlen_outputs(op, q, v, grad_out, out, lse);
  if (gemm) {
    const auto [grad_q, grad_k, grad_v] = backward_by_sequence(
        grad_out, q, k, v, out, lse, lengths,
        [&](const at::Tensor& grad_out_b, const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
            const at::Tensor& out_b, const at::Tensor& lse_b) {
          PreparedBackward pb = prepare_backward(op, grad_out_b, q_b, k_b, v_b, out_b, lse_b, std::nullopt,
                                                 is_causal, scale, cpu_support(), window, softcap, sinks);
          gemm_backward(pb, cpu::plan_gemm(pb.params.fwd, /*backward=*/true));
          return std::make_tuple(pb.grad_q, pb.grad_k, pb.grad_v);
        });
    return {grad_q, grad_k, grad_v, sinks_gradient_from_output(sinks, lse.t(), grad_out, out)};
  }
  PreparedBackward b = prepare_backward(op, as_one_batch(grad_out), as_one_batch(q), as_one_batch(k), as_one_batch(v),
                                        as_one_batch(out), lse.unsqueeze(0), std::nullopt, is_causal, scale,
                                        cpu_support(), window, softcap, sinks);
  use_packed_gradients(b);
  b.params.fwd.varlen = host_varlen(lengths);
  cpu::backward(b.params);
  return {as_packed(b.grad_q, q.size(2)), as_packed(b.grad_k, k.size(2)), as_packed(b.grad_v, v.size(2)),
          sinks_gradient_from_output(sinks, lse.t(), grad_out, out)};
}

std::string plan_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask, bool is_causal, std::optional<double> scale,
                     std::optional<c10::string_view> family, bool backward, at::OptionalIntArrayRef window,
                     std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.plan";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  // The call's checks.
  const PreparedInputs in =
      prepare_forward(op, q, k, v, attn_mask, is_causal, scale, cpu_support(), window, softcap, sinks);
  return (gemm ? cpu::plan_gemm(in.params, backward) : cpu::plan(backward)).describe();
}

std::string plan_varlen_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, bool is_causal, std::optional<double> scale,
                            std::optional<c10::string_view> family, bool backward, at::OptionalIntArrayRef window,
                            std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.plan_varlen";
  const bool gemm = parse_family(op, family, q) == PlanRequest::FamilyChoice::Gemm;
  check_window(op, window);
  check_softcap_and_sinks(op, q, softcap, sinks, cpu_support());
  check_varlen_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  // The gemm family's blocks as for the longest sequence.
  Plan plan = gemm ? fusedattn::plan_gemm(q.size(1), max_seqlen_q, max_seqlen_k, q.size(2),
                                          cpu::kGemmScoreElements, backward)
                   : cpu::plan(backward);
  plan.varlen = true;
  return plan.describe();
}

// The CPU runs forward_kvcache as one forward per sequence.
std::string plan_kvcache_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             bool is_causal, std::optional<double> scale, std::optional<int64_t> num_splits,
                             std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
                             at::OptionalIntArrayRef window, std::optional<double> softcap,
                             const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
                             const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table) {
  const char* op = "fusedattn.plan_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  Plan plan = cpu::plan(/*backward=*/false);
  if (cu_seqlens_q) {
    check_window(op, window);
    check_softcap_and_sinks(op, q, softcap, sinks, cpu_support());
    check_packed_kvcache_inputs(op, q, k_cache, v_cache, seqused_k_of(op, seqused_k), *cu_seqlens_q, std::nullopt,
                                std::nullopt, block_table);
    plan.varlen = true;
  } else if (block_table) {
    // Pages: every sequence's call is planned as one over a page of keys.
    check_caches(op, q, k_cache, v_cache);
    (void)CacheStore(op, q, k_cache, v_cache, q.size(0), block_table);
    auto page_per_sequence = [&](const at::Tensor& cache) {
      return cache.narrow(0, 0, 1).expand({q.size(0), cache.size(1), cache.size(2), cache.size(3)});
    };
    prepare_forward(op, q, page_per_sequence(k_cache), page_per_sequence(v_cache), std::nullopt, is_causal, scale,
                    cpu_support(), window, softcap, sinks);
  } else {
    prepare_forward(op, q, k_cache, v_cache, std::nullopt, is_causal, scale, cpu_support(), window, softcap, sinks);
  }
  return plan.describe();
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
  m.impl("forward_kvcache", &forward_kvcache_cpu);
  m.impl("forward_varlen", &forward_varlen_cpu);
  m.impl("backward_varlen", &backward_varlen_cpu);
  m.impl("plan", &plan_cpu);
  m.impl("plan_kvcache", &plan_kvcache_cpu);
  m.impl("plan_varlen", &plan_varlen_cpu);
}

}  // namespace fusedattn::ops
