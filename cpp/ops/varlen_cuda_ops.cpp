// forward_varlen and backward_varlen on CUDA: the packed batch runs as one
// [1, H, total, d] batch whose rows cu_seqlens cut into sequences
// (VarlenParams, params.h), the kernels walking the planner's longest-first
// work lists. The checks read cu_seqlens on the host, which waits for the
// stream once a call. Also forward_kvcache's packed queries (cu_seqlens_q):
// the same kernels, the keys a KV cache's rows (VarlenParams::seqused_k).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../cuda/plan.h"
#include "checks.h"
#include "gemm_attention.h"
#include "kvcache.h"
#include "operators_cuda.h"
#include "paged_cache.h"
#include "unfilled.h"
#include "varlen.h"

namespace fusedattn::ops {
namespace {

// The device memory a packed call's kernels read besides the operands:
// cu_seqlens (or a KV cache's lengths) and the work lists, which `p` points at.
struct VarlenOperands {
  at::Tensor cu_q, cu_k, query_tiles, key_tiles;

  VarlenOperands(VarlenParams& p, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k)
      : cu_q(cu_seqlens_q.contiguous()), cu_k(cu_seqlens_k.contiguous()) {
    p.cu_seqlens_q = cu_q.data_ptr<int32_t>();
    p.cu_seqlens_k = cu_k.data_ptr<int32_t>();
    p.batch = cu_q.numel() - 1;
  }
  // Keys from a KV cache: seqused_k int32 [B] on the device, rows b x cache_rows on.
  VarlenOperands(VarlenParams& p, const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, int64_t cache_rows)
      : cu_q(cu_seqlens_q.contiguous()), cu_k(seqused_k.contiguous()) {
    p.cu_seqlens_q = cu_q.data_ptr<int32_t>();
    p.seqused_k = cu_k.data_ptr<int32_t>();
    p.cache_rows = cache_rows;
    p.batch = cu_q.numel() - 1;
  }

  // Copies the plan's work lists to the device (through pinned memory, without waiting) and points p at them.
  void upload(VarlenParams& p, const cuda::VarlenWork& work, const at::Tensor& like) {
    query_tiles = to_device(work.query_tiles, like);
    key_tiles = to_device(work.key_tiles, like);
    p.query_tiles = query_tiles.data_ptr<int32_t>();
    p.query_items = query_tiles.numel() / 2;
    p.key_tiles = key_tiles.data_ptr<int32_t>();
    p.key_items = key_tiles.numel() / 2;
  }

 private:
  static at::Tensor to_device(const std::vector<int32_t>& items, const at::Tensor& like) {
    const int64_t n = static_cast<int64_t>(items.size());
    at::Tensor host = empty_unfilled({n}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    if (n > 0) std::memcpy(host.data_ptr<int32_t>(), items.data(), n * sizeof(int32_t));
    return empty_unfilled({n}, like.options().dtype(at::kInt)).copy_(host, /*non_blocking=*/true);
  }
};

cuda::HostSequences host_sequences(const VarlenLengths& lengths) {
  return {lengths.cu_q.data_ptr<int32_t>(), lengths.cu_k.data_ptr<int32_t>(), lengths.batch};
}

// The checks every packed call makes before it reads anything else.
VarlenLengths check_varlen_call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k, at::OptionalIntArrayRef window, std::optional<double> softcap,
                                const std::optional<at::Tensor>& sinks) {
  check_window(op, window);
  check_softcap_and_sinks(op, q, softcap, sinks, cuda_dense_support());
  return check_varlen_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
}

// A packed call's plan from the gemm family (cuda::plan_gemm: forced, or no
// fused kernel takes it), as for its longest sequence; nullopt otherwise.
std::optional<Plan> varlen_gemm_plan(const ForwardParams& packed, const PlanRequest& request, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, bool backward) {
  ForwardParams longest = packed;
  longest.shape.seqlen_q = max_seqlen_q;
  longest.shape.seqlen_k = max_seqlen_k;
  std::optional<Plan> plan = with_torch_errors([&] { return cuda::plan_gemm(longest, request, backward); });
  if (plan) plan->varlen = true;
  return plan;
}

std::tuple<at::Tensor, at::Tensor> forward_varlen_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
                                                       std::optional<double> scale,
                                                       std::optional<c10::string_view> family,
                                                       at::OptionalIntArrayRef window, std::optional<double> softcap,
                                                       const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.forward_varlen";
  const VarlenLengths lengths = check_varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  window, softcap, sinks);
  PreparedInputs in = prepare_forward(op, as_one_batch(q), as_one_batch(k), as_one_batch(v), std::nullopt, is_causal,
                                      scale, cuda_dense_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  const PlanRequest request = family_request(op, family, q);
  if (varlen_gemm_plan(in.params, request, max_seqlen_q, max_seqlen_k, /*backward=*/false))
    return forward_by_sequence(q, k, v, lengths, [&](const at::Tensor& q_b, const at::Tensor& k_b,
                                                     const at::Tensor& v_b, const at::Tensor& out_b,
                                                     const at::Tensor& lse_b) {
      const PreparedInputs s = prepare_forward(op, q_b, k_b, v_b, std::nullopt, is_causal, scale, cuda_dense_support(),
                                               window, softcap, sinks);
      gemm_forward(s, *with_torch_errors([&] { return cuda::plan_gemm(s.params, request, false); }), out_b, lse_b);
    });
  pad_to_kernel_head_dim(in, in.params.shape, /*backward=*/false);
  at::Tensor out = empty_unfilled({q.size(0), q.size(1), in.params.shape.head_dim_v}, q.options());
  at::Tensor lse = empty_unfilled({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  set_forward_outputs(in.params, as_one_batch(out), lse.unsqueeze(0));
  VarlenOperands operands(in.params.varlen, cu_seqlens_q, cu_seqlens_k);
  Plan plan = with_torch_errors([&] { return cuda::plan_forward(in.params, request); });
  operands.upload(in.params.varlen,
                  with_torch_errors([&] { return cuda::schedule_varlen(in.params, host_sequences(lengths), plan); }), q);
  run_forward(in.params, plan, q, stream_of(q));
  return {unpadded(out, v.size(2)), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_varlen_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool is_causal, std::optional<double> scale, std::optional<c10::string_view> family,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.backward_varlen";
  const VarlenLengths lengths = check_varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  window, softcap, sinks);
  check_varlen_outputs(op, q, v, grad_out, out, lse);
  const PlanRequest request = family_request(op, family, q);
  // Decided before prepare_backward, whose packed gradients the gemm family does not use.
  const bool on_gemm = varlen_gemm_plan(prepare_forward(op, as_one_batch(q), as_one_batch(k), as_one_batch(v),
                                                        std::nullopt, is_causal, scale, cuda_dense_support(), window,
                                                        softcap, sinks)
                                            .params,
                                        request, max_seqlen_q, max_seqlen_k, /*backward=*/true)
                           .has_value();
  const c10::cuda::CUDAGuard guard(q.device());
  if (on_gemm) {
    const auto [grad_q, grad_k, grad_v] = backward_by_sequence(
        grad_out, q, k, v, out, lse, lengths,
        [&](const at::Tensor& grad_out_b, const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
            const at::Tensor& out_b, const at::Tensor& lse_b) {
          PreparedBackward s = prepare_backward(op, grad_out_b, q_b, k_b, v_b, out_b, lse_b, std::nullopt, is_causal,
                                                scale, cuda_dense_support(), window, softcap, sinks);
          gemm_backward(s, *with_torch_errors([&] { return cuda::plan_gemm(s.params.fwd, request, true); }));
          return std::make_tuple(s.grad_q, s.grad_k, s.grad_v);
        });
    return {grad_q, grad_k, grad_v, sinks_gradient_from_output(sinks, lse.t(), grad_out, out)};
  }
  PreparedBackward b = prepare_backward(op, as_one_batch(grad_out), as_one_batch(q), as_one_batch(k), as_one_batch(v),
                                        as_one_batch(out), lse.unsqueeze(0), std::nullopt, is_causal, scale,
                                        cuda_dense_support(), window, softcap, sinks);
  // Padded, the gradients are pad_head_dims' (as_packed copies them out cut to the call's head dims).
  if (!pad_to_kernel_head_dim(b, b.params.fwd.shape, /*backward=*/true)) use_packed_gradients(b);
  b.params.deterministic = at::globalContext().deterministicAlgorithms();
  VarlenOperands operands(b.params.fwd.varlen, cu_seqlens_q, cu_seqlens_k);
  Plan plan = with_torch_errors([&] { return cuda::plan_backward(b.params, request); });
  operands.upload(b.params.fwd.varlen,
                  with_torch_errors([&] { return cuda::schedule_varlen(b.params.fwd, host_sequences(lengths), plan); }),
                  q);
  const BackwardWorkspaces workspaces(b.params, plan, b.fwd.q, b.fwd.k, b.lse);
  run_backward(b.params, plan, stream_of(q));
  const at::Tensor grad_sinks = sinks_gradient(sinks, b.lse, workspaces.delta);
  return {as_packed(b.grad_q, q.size(2)), as_packed(b.grad_k, k.size(2)), as_packed(b.grad_v, v.size(2)),
          grad_sinks};
}

std::string plan_varlen_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, bool is_causal, std::optional<double> scale,
                             std::optional<c10::string_view> family, bool backward, at::OptionalIntArrayRef window,
                             std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "fusedattn.plan_varlen";
  const VarlenLengths lengths = check_varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  window, softcap, sinks);
  PreparedInputs in = prepare_forward(op, as_one_batch(q), as_one_batch(k), as_one_batch(v), std::nullopt, is_causal,
                                      scale, cuda_dense_support(), window, softcap, sinks);
  const c10::cuda::CUDAGuard guard(q.device());
  const PlanRequest request = family_request(op, family, q);
  if (const auto gemm = varlen_gemm_plan(in.params, request, max_seqlen_q, max_seqlen_k, backward))
    return gemm->describe();
  pad_to_kernel_head_dim(in, in.params.shape, backward);
  VarlenOperands operands(in.params.varlen, cu_seqlens_q, cu_seqlens_k);
  const int64_t d = in.params.shape.head_dim;  // grad_out [total_q, Hq, d], as [1, Hq, total_q, d]
  const BackwardParams b = backward_plan_params(in.params, {q.size(0) * q.size(1) * d, d, q.size(1) * d});
  return with_torch_errors([&] {
    Plan plan = backward ? cuda::plan_backward(b, request) : cuda::plan_forward(in.params, request);
    cuda::schedule_varlen(in.params, host_sequences(lengths), plan);
    return plan.describe();
  });
}

// Host offsets of the keys packed queries attend to in a cache (their
// lengths as if packed: the planner orders the work by them).
struct CacheSequences {
  std::vector<int32_t> cu_k;
  cuda::HostSequences host;

  CacheSequences(const CacheSequences&) = delete;  // host points into cu_k
  CacheSequences& operator=(const CacheSequences&) = delete;
  explicit CacheSequences(const PackedCacheLengths& lengths) : cu_k(lengths.batch() + 1, 0) {
    int64_t total = 0;
    for (int64_t b = 0; b < lengths.batch(); ++b) {
      total += lengths.keys(b);
      TORCH_CHECK(total < (int64_t(1) << 31), "fusedattn.forward_kvcache: packed queries attend to fewer than 2^31 "
                  "cached positions in all");
      cu_k[b + 1] = static_cast<int32_t>(total);
    }
    host = {lengths.cu_q.data_ptr<int32_t>(), cu_k.data(), lengths.batch()};
  }

  // The keys per sequence, int32 [B] on q's device.
  at::Tensor seqused_k(const at::Tensor& q) const {
    std::vector<int32_t> used(host.batch);
    for (int64_t b = 0; b < host.batch; ++b) used[b] = cu_k[b + 1] - cu_k[b];
    return at::tensor(used, at::TensorOptions().dtype(at::kInt)).to(q.device());
  }
};

// Packed queries and the caches as the varlen kernels take them: q as one
// [1, Hq, total_q, d] batch, the caches as their first sequence's [1, Hkv,
// max_len, d], whose rows continue into the next sequences' (cache_rows);
// read in place, so at a head dim the kernels serve and rows they can load.
PreparedInputs prepare_packed_kvcache(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, bool is_causal, std::optional<double> scale,
                                      at::OptionalIntArrayRef window, std::optional<double> softcap,
                                      const std::optional<at::Tensor>& sinks) {
  const std::vector<int64_t> served = cuda::served_head_dims(/*backward=*/false);
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(v_cache.size(3) == d && std::find(served.begin(), served.end(), d) != served.end(), op,
              ": on CUDA packed queries (cu_seqlens_q) read the caches in place, at head dims ",
              c10::IntArrayRef(served), " with d_v = d, got d = ", d, " and d_v = ", v_cache.size(3));
  const at::Tensor k0 = k_cache.narrow(0, 0, 1), v0 = v_cache.narrow(0, 0, 1);
  PreparedInputs in = prepare_forward(op, as_one_batch(q), k0, v0, std::nullopt, is_causal, scale, cuda_support(),
                                      window, softcap, sinks);
  const int64_t rows = k_cache.stride(2) > 0 ? k_cache.stride(0) / k_cache.stride(2) : 0;
  TORCH_CHECK(in.k.data_ptr() == k0.data_ptr() && in.v.data_ptr() == v0.data_ptr() &&
                  in.k.strides() == k0.strides() && in.v.strides() == v0.strides() &&
                  (k_cache.size(0) == 1 || (rows > 0 && k_cache.stride(0) == rows * k_cache.stride(2) &&
                                            v_cache.stride(0) == rows * v_cache.stride(2))),
              op, ": on CUDA packed queries (cu_seqlens_q) need caches with a contiguous last dimension, rows on "
              "16-byte boundaries and batch strides that are the same multiple of K's and V's row strides "
              "(contiguous caches are), got strides ", k_cache.strides(), " and ", v_cache.strides());
  in.params.varlen.cache_rows = rows;
  return in;
}

void check_no_decode_overrides(const char* op, std::optional<int64_t> num_splits,
                               std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  TORCH_CHECK(!num_splits && !merge_in_cluster && !warps, op, ": num_splits, merge_in_cluster and warps choose "
              "decode blocks; packed queries (cu_seqlens_q) run the varlen forward, pass None");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_packed_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    bool is_causal, std::optional<double> scale, std::optional<int64_t> num_splits,
    std::optional<bool> merge_in_cluster, std::optional<int64_t> warps, at::OptionalIntArrayRef window,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& block_table) {
  const char* op = "fusedattn.forward_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  check_window(op, window);
  check_softcap_and_sinks(op, q, softcap, sinks, cuda_support());
  const PackedCacheLengths lengths =
      check_packed_kvcache_inputs(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new, block_table);
  const c10::cuda::CUDAGuard guard(q.device());
  // Paged caches: the kernels read each sequence's pages gathered into a cache
  // of its own, and the new keys go to both.
  const CacheStore store(op, q, k_cache, v_cache, lengths.batch(), block_table);
  const auto [k_rows, v_rows] = store.gathered(lengths);
  // Every check and the plan before the append: an error leaves the caches as they were.
  PreparedInputs in = prepare_packed_kvcache(op, q, k_rows, v_rows, is_causal, scale, window, softcap, sinks);
  const CacheSequences sequences(lengths);
  VarlenOperands operands(in.params.varlen, cu_seqlens_q, sequences.seqused_k(q), in.params.varlen.cache_rows);
  const PlanRequest request = family_request(op, std::nullopt, q);
  Plan plan = with_torch_errors([&] { return cuda::plan_forward(in.params, request); });
  operands.upload(in.params.varlen,
                  with_torch_errors([&] { return cuda::schedule_varlen(in.params, sequences.host, plan); }), q);
  at::Tensor out = empty_unfilled({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  at::Tensor lse = empty_unfilled({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  set_forward_outputs(in.params, as_one_batch(out), lse.unsqueeze(0));
  if (k_new) {
    store.append_packed(*k_new, *v_new, lengths);
    if (store.paged())
      CacheStore(op, q, k_rows, v_rows, lengths.batch(), std::nullopt).append_packed(*k_new, *v_new, lengths);
  }
  run_forward(in.params, plan, q, stream_of(q));
  return {out, lse};
}

std::string plan_packed_kvcache_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& seqused_k, bool is_causal,
                                     std::optional<double> scale, std::optional<int64_t> num_splits,
                                     std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
                                     at::OptionalIntArrayRef window, std::optional<double> softcap,
                                     const std::optional<at::Tensor>& sinks,
                                     const std::optional<at::Tensor>& block_table) {
  const char* op = "fusedattn.plan_kvcache";
  check_no_decode_overrides(op, num_splits, merge_in_cluster, warps);
  check_window(op, window);
  check_softcap_and_sinks(op, q, softcap, sinks, cuda_support());
  const PackedCacheLengths lengths = check_packed_kvcache_inputs(op, q, k_cache, v_cache, seqused_k, cu_seqlens_q,
                                                                 std::nullopt, std::nullopt, block_table);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto [k_rows, v_rows] = CacheStore(op, q, k_cache, v_cache, lengths.batch(), block_table).gathered(lengths);
  PreparedInputs in = prepare_packed_kvcache(op, q, k_rows, v_rows, is_causal, scale, window, softcap, sinks);
  const CacheSequences sequences(lengths);
  VarlenOperands operands(in.params.varlen, cu_seqlens_q, seqused_k, in.params.varlen.cache_rows);
  const PlanRequest request = family_request(op, std::nullopt, q);
  return with_torch_errors([&] {
    Plan plan = cuda::plan_forward(in.params, request);
    cuda::schedule_varlen(in.params, sequences.host, plan);
    return plan.describe();
  });
}

TORCH_LIBRARY_IMPL(fusedattn, CUDA, m) {
  m.impl("forward_varlen", &forward_varlen_cuda);
  m.impl("backward_varlen", &backward_varlen_cuda);
  m.impl("plan_varlen", &plan_varlen_cuda);
}

}  // namespace fusedattn::ops
