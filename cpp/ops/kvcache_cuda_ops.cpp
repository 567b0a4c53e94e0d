// forward_kvcache on CUDA: the decode family (cpp/cuda/decode). Nothing here
// waits for the device, so decoding steps queue back to back and can be
// captured in a CUDA graph. Packed queries (cu_seqlens_q) run the varlen
// forward instead (varlen_cuda_ops.cpp), which reads their lengths on the host;
// what no kernel takes, the gemm family a sequence at a time (the same).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "../cuda/decode/forward_kvcache.h"
#include "../cuda/plan.h"
#include "checks.h"
#include "gemm_attention.h"
#include "kvcache.h"
#include "operators_cuda.h"
#include "paged_cache.h"
#include "unfilled.h"

namespace fusedattn::ops {
namespace {

const DeviceSupport& decode_support() {
  static const DeviceSupport support{"CUDA", {at::kHalf, at::kBFloat16}, cuda::instantiated_head_dims("decode"),
                                     /*aligned_rows=*/true, /*own_value_head_dim=*/false, /*softcap=*/true,
                                     /*sinks=*/true};
  return support;
}

Plan plan_decode(const char* op, const KVCacheParams& p, std::optional<int64_t> num_splits,
                 std::optional<bool> merge_in_cluster, std::optional<int64_t> warps) {
  const PlanRequest request = decode_request(op, num_splits, merge_in_cluster, warps);
  return with_torch_errors([&] { return cuda::plan_decode(p, request); });
}

// The decode kernel's arrival counters (KVCacheParams::split_arrivals): at
// least `count` of them, zero. The kernel zeroes what it counted, so outside
// graph capture one buffer per device and stream serves every call on that
// stream (calls on one stream run in order; a fill kernel per call cost as
// much as the combine kernel the counters replaced). A call being captured
// gets counters of its own, zeroed in the graph: a graph replays on whatever
// stream is current, maybe beside eager calls or other graphs, and memory
// allocated during capture belongs to the graph's pool, unzeroed until the
// graph first runs. (A stream handle reused while its last decode kernel
// still runs would share that kernel's counters; PyTorch's streams are
// pooled, never destroyed.)
at::Tensor arrival_counters(const at::Tensor& like, int64_t count, cudaStream_t stream) {
  const auto options = like.options().dtype(at::kInt);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  // Zeroed without at::zeros's deterministic-mode fill before it.
  auto zeros = [&](int64_t n) { return empty_unfilled({n}, options).zero_(); };
  if (capture != cudaStreamCaptureStatusNone) return zeros(count);
  static std::mutex mutex;
  // Never destroyed: freeing device memory at process exit can outlive the CUDA context.
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buffer = (*buffers)[{like.device().index(), stream}];
  // An outgrown buffer is freed in stream order: the calls before still use it.
  if (!buffer.defined() || buffer.numel() < count)
    buffer = zeros(buffer.defined() ? std::max(count, 2 * buffer.numel()) : count);
  return buffer;
}

// A CUDA block_table also brings a CPU call here (the dispatcher follows any CUDA argument).
void check_block_table_device(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& block_table) {
  TORCH_CHECK(!block_table || q.is_cuda(), op, ": block_table must be on q's device (", q.device(), "), got ",
              block_table->device());
}

// The decode kernel's inputs. Paged caches are checked as one page per
// sequence (a view), then the params take the whole table: the pages'
// stride, and max_blocks x page_size positions a sequence.
struct DecodeInputs {
  PreparedInputs in;
  at::Tensor table;  // contiguous block_table, or undefined
};

DecodeInputs prepare_decode(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            bool is_causal, std::optional<double> scale, at::OptionalIntArrayRef window,
                            std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& block_table) {
  auto per_sequence = [&](const at::Tensor& cache) {
    return block_table ? cache.narrow(0, 0, 1).expand({q.size(0), -1, -1, -1}) : cache;
  };
  const at::Tensor k_seen = per_sequence(k_cache), v_seen = per_sequence(v_cache);
  DecodeInputs d{prepare_forward(op, q, k_seen, v_seen, std::nullopt, is_causal, scale, decode_support(), window,
                                 softcap, sinks),
                 {}};
  // The caches are written in place: they cannot be replaced by aligned copies.
  TORCH_CHECK(d.in.k.is_same(k_seen) && d.in.v.is_same(v_seen), op,
              ": on CUDA k_cache and v_cache need a contiguous last dimension and rows starting "
              "on 16-byte boundaries (strides multiples of ", 16 / k_cache.element_size(),
              " elements), got strides ", k_cache.strides(), " and ", v_cache.strides());
  if (block_table) {
    const int64_t aligned = 16 / k_cache.element_size();  // elements in 16 bytes: the copies' unit
    TORCH_CHECK(k_cache.stride(0) % aligned == 0 && v_cache.stride(0) % aligned == 0, op,
                ": on CUDA the pages of k_cache and v_cache must start on 16-byte boundaries (page strides "
                "multiples of ", aligned, " elements), got strides ", k_cache.strides(), " and ", v_cache.strides());
    d.table = block_table->contiguous();
    ForwardParams& a = d.in.params;
    a.shape.seqlen_k = d.table.size(1) * k_cache.size(2);
    a.k_strides.batch = k_cache.stride(0);
    a.v_strides.batch = v_cache.stride(0);
    apply_window(op, a, window);  // capped at the page prepare_forward saw, the positions a sequence holds now
  }
  return d;
}

// The gemm family's plan where no kernel takes the call (cuda::plan_kvcache_gemm,
// from the dtype, heads, head dims and q's rows against the caches' capacity;
// nothing is read); nullopt also for a malformed call, which the kernels'
// checks then refuse.
std::optional<Plan> kvcache_gemm_plan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      bool packed, const std::optional<at::Tensor>& block_table) {
  const auto dtype = q.scalar_type();
  if (q.dim() != (packed ? 3 : 4) || k_cache.dim() != 4 || v_cache.dim() != 4 ||
      (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16))
    return std::nullopt;
  ForwardParams p;
  p.dtype = dtype_of(q.scalar_type());
  p.shape.batch = packed ? 1 : q.size(0);
  p.shape.heads_q = q.size(-2 - !packed);
  p.shape.heads_kv = k_cache.size(1);
  p.shape.seqlen_q = packed ? q.size(0) : q.size(2);
  p.shape.seqlen_k = block_table && block_table->dim() == 2 ? block_table->size(1) * k_cache.size(2) : k_cache.size(2);
  p.shape.head_dim = q.size(-1);
  p.shape.head_dim_v = v_cache.size(-1);
  std::optional<Plan> plan = cuda::plan_kvcache_gemm(p, packed);
  if (plan) plan->varlen = packed;
  return plan;
}

// Why the gemm family serves a KV-cache call, for its errors.
constexpr const char* kKvcacheOnGemm =
    "this call runs on the gemm family (float32, a head dim the kernels are not built for, or d_v != d)";

// forward_kvcache on the gemm family, a sequence at a time (its cache lengths
// read on the host: no graph capture).
std::tuple<at::Tensor, at::Tensor> forward_kvcache_gemm(
    const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    bool is_causal, std::optional<double> scale, at::OptionalIntArrayRef window, std::optional<double> softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& block_table) {
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(q.device().index()).stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, op, ": ", kKvcacheOnGemm,
              ", which reads the cache lengths on the host: it cannot be captured in a CUDA graph");
  const SequenceForward forward = [&](const at::Tensor& q_b, const at::Tensor& k_b, const at::Tensor& v_b,
                                      const at::Tensor& out_b, const at::Tensor& lse_b) {
    const PreparedInputs in = prepare_forward(op, q_b, k_b, v_b, std::nullopt, is_causal, scale, cuda_dense_support(),
                                              window, softcap, sinks);
    gemm_forward(in, *cuda::plan_kvcache_gemm(in.params, cu_seqlens_q.has_value()), out_b, lse_b);
  };
  return forward_kvcache_each_sequence(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new,
                                       block_table, forward);
}

// What a KV-cache call on the gemm family checks first (a plan too): the
// decode kernel's overrides refused, the window, scale, soft-cap and sinks.
void check_kvcache_gemm_call(const char* op, const at::Tensor& q, std::optional<int64_t> num_splits,
                             std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
                             at::OptionalIntArrayRef window, std::optional<double> scale,
                             std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(!num_splits && !merge_in_cluster && !warps, op, ": num_splits, merge_in_cluster and warps choose "
              "decode blocks; ", kKvcacheOnGemm, ", pass None");
  check_window(op, window);  // before any sequence's keys are appended
  check_scale(op, scale);
  check_softcap_and_sinks(op, q, softcap, sinks, cuda_dense_support());
}

void point_pages(KVCacheParams& p, const at::Tensor& table, const at::Tensor& k_cache) {
  if (!table.defined()) return;
  p.block_table = table.data_ptr<int32_t>();
  p.max_blocks = table.size(1);
  p.page_size = k_cache.size(2);
  p.pages = k_cache.size(0);
}

std::tuple<at::Tensor, at::Tensor> forward_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, bool is_causal, std::optional<double> scale,
    std::optional<int64_t> num_splits, std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
    at::OptionalIntArrayRef window, std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& block_table) {
  check_block_table_device("fusedattn.forward_kvcache", q, block_table);
  check_caches("fusedattn.forward_kvcache", q, k_cache, v_cache);
  if (kvcache_gemm_plan(q, k_cache, v_cache, cu_seqlens_q.has_value(), block_table)) {
    check_kvcache_gemm_call("fusedattn.forward_kvcache", q, num_splits, merge_in_cluster, warps, window, scale,
                            softcap, sinks);
    return forward_kvcache_gemm("fusedattn.forward_kvcache", q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                is_causal, scale, window, softcap, sinks, cu_seqlens_q, block_table);
  }
  if (cu_seqlens_q)
    return forward_packed_kvcache_cuda(q, k_cache, v_cache, cache_seqlens, *cu_seqlens_q, k_new, v_new, is_causal,
                                       scale, num_splits, merge_in_cluster, warps, window, softcap, sinks,
                                       block_table);
  const char* op = "fusedattn.forward_kvcache";
  const int64_t n_new = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table);
  DecodeInputs decode = prepare_decode(op, q, k_cache, v_cache, is_causal, scale, window, softcap, sinks, block_table);
  PreparedInputs& in = decode.in;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  // cache_seqlens stays on the device: reading it here would cost a
  // synchronisation per call, per layer per decoding step, and stop a step
  // from being captured in a graph. A sequence whose lengths do not fit the
  // cache is not appended to and gets NaN in out and lse instead of an error.
  KVCacheParams p;
  auto outputs = allocate_forward_outputs(in);
  p.attn = in.params;
  point_pages(p, decode.table, k_cache);
  const at::Tensor lengths = cache_seqlens.contiguous();
  p.cache_seqlens = lengths.data_ptr<int32_t>();
  at::Tensor k_append, v_append;
  if (n_new > 0) {
    k_append = as_kernel_operand(*k_new, decode_support());
    v_append = as_kernel_operand(*v_new, decode_support());
    p.n_new = n_new;
    p.k_new = k_append.data_ptr();
    p.v_new = v_append.data_ptr();
    p.k_new_strides = strides_of(k_append);
    p.v_new_strides = strides_of(v_append);
  }
  const Plan plan = plan_decode(op, p, num_splits, merge_in_cluster, warps);
  p.num_splits = plan.num_splits;
  p.merge_in_cluster = plan.merge_in_cluster;
  at::Tensor partial_out, partial_lse, split_arrivals;
  if (p.num_splits > 1 && !p.merge_in_cluster) {
    partial_out = empty_unfilled({p.num_splits, q.size(0), q.size(1), q.size(2), q.size(3)},
                                 q.options().dtype(at::kFloat));
    partial_lse = empty_unfilled({p.num_splits, q.size(0), q.size(1), q.size(2)}, partial_out.options());
    split_arrivals = arrival_counters(q, cuda::decode_items(p.attn.shape), stream);
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
    p.split_arrivals = split_arrivals.data_ptr<int32_t>();
  }
  cuda::forward_kvcache(p, plan, stream);
  return outputs;
}

std::string plan_kvcache_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              bool is_causal, std::optional<double> scale, std::optional<int64_t> num_splits,
                              std::optional<bool> merge_in_cluster, std::optional<int64_t> warps,
                              at::OptionalIntArrayRef window, std::optional<double> softcap,
                              const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seqlens_q,
                              const std::optional<at::Tensor>& seqused_k,
                              const std::optional<at::Tensor>& block_table) {
  check_block_table_device("fusedattn.plan_kvcache", q, block_table);
  check_caches("fusedattn.plan_kvcache", q, k_cache, v_cache);
  if (const auto gemm = kvcache_gemm_plan(q, k_cache, v_cache, cu_seqlens_q.has_value(), block_table)) {
    check_kvcache_gemm_call("fusedattn.plan_kvcache", q, num_splits, merge_in_cluster, warps, window, scale, softcap,
                            sinks);
    return gemm->describe();
  }
  if (cu_seqlens_q)
    return plan_packed_kvcache_cuda(q, k_cache, v_cache, *cu_seqlens_q,
                                    seqused_k_of("fusedattn.plan_kvcache", seqused_k), is_causal, scale, num_splits,
                                    merge_in_cluster, warps, window, softcap, sinks, block_table);
  const char* op = "fusedattn.plan_kvcache";
  if (block_table) check_cache_layout(op, q, k_cache, q.size(0), block_table);
  const DecodeInputs decode =
      prepare_decode(op, q, k_cache, v_cache, is_causal, scale, window, softcap, sinks, block_table);
  const c10::cuda::CUDAGuard guard(q.device());
  KVCacheParams p;
  p.attn = decode.in.params;
  point_pages(p, decode.table, k_cache);
  return plan_decode(op, p, num_splits, merge_in_cluster, warps).describe();
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedattn, CUDA, m) {
  m.impl("forward_kvcache", &forward_kvcache_cuda);
  m.impl("plan_kvcache", &plan_kvcache_cuda);
}

}  // namespace fusedattn::ops
