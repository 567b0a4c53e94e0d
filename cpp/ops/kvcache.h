// forward_kvcache's device-independent part: checks, and (for devices without
// a decode kernel) the in-place append of k_new/v_new followed by one
// attention problem per sequence over its valid prefix; with cu_seqlens_q,
// packed queries of many lengths (chunked prefill and decoding in one call).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "checks.h"
#include "varlen.h"

namespace fusedattn::ops {

// The checks of the caches that every forward_kvcache call shares: 4-D, k's
// and v's first three sizes equal, two tensors, q's dtype and device.
void check_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache);

// Checks shapes, dtypes and devices of every argument (not the values of
// cache_seqlens) and returns Nnew, the positions k_new/v_new append (0 if none).
// With block_table the caches are pages (paged_cache.h).
int64_t check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                             const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new,
                             const std::optional<at::Tensor>& block_table = std::nullopt);

// Runs `forward(q_b, k_b, v_b, out_b, lse_b)` (varlen.h) for every sequence b,
// where k_b and v_b are the first cache_seqlens[b] + Nnew cached positions
// (after the append; through block_table's pages if given), and returns (out, lse).
std::tuple<at::Tensor, at::Tensor> forward_kvcache_by_sequence(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& block_table, const SequenceForward& forward);

// Packed queries: q [total_q, Hq, d], sequence b's rows cu_seqlens_q[b] :
// cu_seqlens_q[b + 1]; k_new and v_new (if given) [total_q, Hkv, d] and
// [total_q, Hkv, d_v], the new keys of a sequence being its queries' rows.
// The lengths on the host, checked against the caches.
struct PackedCacheLengths {
  at::Tensor cu_q;              // int32 [B + 1]
  std::vector<int32_t> cached;  // cache_seqlens
  bool appends = false;
  int64_t batch() const { return static_cast<int64_t>(cached.size()); }
  int64_t start_q(int64_t b) const { return cu_q.data_ptr<int32_t>()[b]; }
  int64_t len_q(int64_t b) const { return start_q(b + 1) - start_q(b); }
  // The keys sequence b attends to: its cached positions and (appending) its new ones.
  int64_t keys(int64_t b) const { return cached[b] + (appends ? len_q(b) : 0); }
};

PackedCacheLengths check_packed_kvcache_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                               const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new,
                                               const std::optional<at::Tensor>& v_new,
                                               const std::optional<at::Tensor>& block_table = std::nullopt);

// plan_kvcache's seqused_k, which packed queries need (their work list's order).
const at::Tensor& seqused_k_of(const char* op, const std::optional<at::Tensor>& seqused_k);

// forward_kvcache_by_sequence for packed queries: the append, then
// `forward` per sequence with queries, its keys, and the [1, Hq, n, d_v]
// view of out and a [1, Hq, n] lse (copied into lse [Hq, total_q]).
std::tuple<at::Tensor, at::Tensor> forward_packed_kvcache_by_sequence(
    const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
    const SequenceForward& forward);

// forward_kvcache a sequence at a time (the CPU's, and CUDA's gemm family):
// packed queries with cu_seqlens_q, else q [B, Hq, Nq, d].
std::tuple<at::Tensor, at::Tensor> forward_kvcache_each_sequence(
    const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& block_table, const SequenceForward& forward);

}  // namespace fusedattn::ops
