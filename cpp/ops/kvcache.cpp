#include "kvcache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>

#include "paged_cache.h"
#include "unfilled.h"
#include "varlen.h"

namespace fusedattn::ops {

void check_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              op, ": k_cache must be [B, Hkv, max_len, d] and v_cache [B, Hkv, max_len, d_v], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(!k_cache.is_same(v_cache), op, ": k_cache and v_cache must be different tensors");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.device() == k_cache.device() && q.device() == v_cache.device(),
              op, ": q, k_cache and v_cache must share dtype and device, got q ", q.scalar_type(), " on ", q.device(),
              ", k_cache ", k_cache.scalar_type(), " on ", k_cache.device(), ", v_cache ", v_cache.scalar_type(),
              " on ", v_cache.device());
}

namespace {

void check_cache_seqlens(const char* op, const at::Tensor& cache_seqlens, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch && cache_seqlens.scalar_type() == at::kInt,
              op, ": cache_seqlens must be int32 [B] = [", batch, "], got ", cache_seqlens.scalar_type(), " ",
              cache_seqlens.sizes());
  TORCH_CHECK(cache_seqlens.device() == q.device(), op, ": cache_seqlens must be on q's device (", q.device(),
              "), got ", cache_seqlens.device());
}

void check_new_keys_like_the_caches(const char* op, const at::Tensor& k_new, const at::Tensor& v_new,
                                    const at::Tensor& k_cache) {
  TORCH_CHECK(k_new.scalar_type() == k_cache.scalar_type() && v_new.scalar_type() == k_cache.scalar_type() &&
                  k_new.device() == k_cache.device() && v_new.device() == k_cache.device(),
              op, ": k_new and v_new must have the caches' dtype and device (", k_cache.scalar_type(), " on ",
              k_cache.device(), "), got ", k_new.scalar_type(), " on ", k_new.device(), " and ",
              v_new.scalar_type(), " on ", v_new.device());
}

}  // namespace

int64_t check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                             const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new,
                             const std::optional<at::Tensor>& block_table) {
  const char* op = "fusedattn.forward_kvcache";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, Hq, Nq, d], got shape ", q.sizes());
  check_caches(op, q, k_cache, v_cache);
  check_cache_layout(op, q, k_cache, q.size(0), block_table);
  TORCH_CHECK(q.size(3) == k_cache.size(3) && k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              op, ": q [B, Hq, Nq, d] and the caches [B, Hkv, max_len, d] need the same d and Hq a "
              "multiple of Hkv, got q ", q.sizes(), " and caches ", k_cache.sizes());
  const int64_t batch = q.size(0);
  check_cache_seqlens(op, cache_seqlens, batch, q);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), op,
              ": k_new and v_new must be given together");
  int64_t n_new = 0;
  if (k_new) {
    TORCH_CHECK(k_new->dim() == 4 && v_new->dim() == 4 && k_new->size(0) == batch &&
                    k_new->size(1) == k_cache.size(1) && k_new->size(3) == k_cache.size(3) &&
                    v_new->sizes() == c10::IntArrayRef({batch, k_cache.size(1), k_new->size(2), v_cache.size(3)}),
                op, ": k_new must be [B, Hkv, Nnew, d] = [", batch, ", ", k_cache.size(1), ", Nnew, ",
                k_cache.size(3), "] and v_new [B, Hkv, Nnew, d_v] with d_v = ", v_cache.size(3), ", got ",
                k_new->sizes(), " and ", v_new->sizes());
    check_new_keys_like_the_caches(op, *k_new, *v_new, k_cache);
    n_new = k_new->size(2);
  }
  return n_new;
}

namespace {

// Checks that every sequence's cached positions plus n_new fit the store and
// its pages, and returns cache_seqlens on the host, contiguous.
at::Tensor checked_cache_lengths(const at::Tensor& cache_seqlens, int64_t n_new, const CacheStore& store) {
  at::Tensor lengths = cache_seqlens.to(at::kCPU).contiguous();
  const int32_t* len = lengths.data_ptr<int32_t>();
  std::vector<int64_t> cached(lengths.size(0)), keys(lengths.size(0));
  for (int64_t b = 0; b < lengths.size(0); ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + n_new <= store.capacity(), "fusedattn.forward_kvcache: sequence ",
                b, " has ", len[b], " cached positions and ", n_new,
                " new ones, but the cache holds ", store.capacity());
    cached[b] = len[b], keys[b] = len[b] + n_new;
  }
  store.check_pages(cached, keys);
  return lengths;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_kvcache_by_sequence(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& block_table, const SequenceForward& forward) {
  const int64_t n_new = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table);
  const int64_t batch = q.size(0);
  const CacheStore store("fusedattn.forward_kvcache", q, k_cache, v_cache, batch, block_table);
  const at::Tensor lengths = checked_cache_lengths(cache_seqlens, n_new, store);
  const int32_t* len = lengths.data_ptr<int32_t>();

  at::Tensor out = empty_unfilled({batch, q.size(1), q.size(2), v_cache.size(3)}, q.options());
  at::Tensor lse = empty_unfilled({batch, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  std::vector<int64_t> keys(batch);
  for (int64_t b = 0; b < batch; ++b) {
    if (k_new) store.append(b, len[b], (*k_new)[b], (*v_new)[b]);  // every append before any read
    keys[b] = len[b] + n_new;
  }
  store.visit_keys(keys, [&](int64_t b, const at::Tensor& k_b, const at::Tensor& v_b) {
    forward(q.narrow(0, b, 1), k_b, v_b, out.narrow(0, b, 1), lse.narrow(0, b, 1));
  });
  return {out, lse};
}

PackedCacheLengths check_packed_kvcache_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                               const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new,
                                               const std::optional<at::Tensor>& v_new,
                                               const std::optional<at::Tensor>& block_table) {
  TORCH_CHECK(q.dim() == 3, op, ": with cu_seqlens_q, q must be [total_q, Hq, d] (packed sequences), got shape ",
              q.sizes());
  check_caches(op, q, k_cache, v_cache);
  const int64_t heads_kv = k_cache.size(1);
  TORCH_CHECK(q.size(2) == k_cache.size(3) && heads_kv > 0 && q.size(1) % heads_kv == 0, op,
              ": q [total_q, Hq, d] and the caches [B, Hkv, max_len, d] need the same d and Hq a multiple of Hkv, "
              "got q ", q.sizes(), " and caches ", k_cache.sizes());
  PackedCacheLengths lengths;
  lengths.cu_q = check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q, "q", std::numeric_limits<int64_t>::max(),
                                  "max_seqlen_q");
  const int64_t batch = lengths.cu_q.size(0) - 1;
  const CacheStore store(op, q, k_cache, v_cache, batch, block_table);
  check_cache_seqlens(op, cache_seqlens, batch, q);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), op, ": k_new and v_new must be given together");
  if (k_new) {
    TORCH_CHECK(k_new->dim() == 3 && v_new->dim() == 3 &&
                    k_new->sizes() == c10::IntArrayRef({q.size(0), heads_kv, k_cache.size(3)}) &&
                    v_new->sizes() == c10::IntArrayRef({q.size(0), heads_kv, v_cache.size(3)}),
                op, ": with cu_seqlens_q, k_new must be [total_q, Hkv, d] = [", q.size(0), ", ", heads_kv, ", ",
                k_cache.size(3), "] and v_new [total_q, Hkv, d_v] with d_v = ", v_cache.size(3), ", got ",
                k_new->sizes(), " and ", v_new->sizes());
    check_new_keys_like_the_caches(op, *k_new, *v_new, k_cache);
  }
  lengths.appends = k_new.has_value();
  const at::Tensor cached = cache_seqlens.to(at::kCPU).contiguous();
  lengths.cached.assign(cached.data_ptr<int32_t>(), cached.data_ptr<int32_t>() + batch);
  std::vector<int64_t> cached_from(batch), keys(batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lengths.cached[b] >= 0 && lengths.keys(b) <= store.capacity(), op, ": sequence ", b, " has ",
                lengths.cached[b], " cached positions and ", lengths.appends ? lengths.len_q(b) : 0,
                " new ones, but the cache holds ", store.capacity());
    cached_from[b] = lengths.cached[b], keys[b] = lengths.keys(b);
  }
  store.check_pages(cached_from, keys);
  return lengths;
}

const at::Tensor& seqused_k_of(const char* op, const std::optional<at::Tensor>& seqused_k) {
  TORCH_CHECK(seqused_k.has_value(), op, ": packed queries (cu_seqlens_q) need seqused_k, the keys each sequence "
              "attends to (cached and new)");
  return *seqused_k;
}

std::tuple<at::Tensor, at::Tensor> forward_packed_kvcache_by_sequence(
    const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& block_table,
    const SequenceForward& forward) {
  const PackedCacheLengths lengths =
      check_packed_kvcache_inputs(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new, block_table);
  const CacheStore store(op, q, k_cache, v_cache, lengths.batch(), block_table);
  at::Tensor out = empty_unfilled({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  at::Tensor lse = empty_unfilled({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  if (k_new) store.append_packed(*k_new, *v_new, lengths);  // before any sequence's attention
  std::vector<int64_t> keys(lengths.batch());
  for (int64_t b = 0; b < lengths.batch(); ++b) keys[b] = lengths.len_q(b) == 0 ? 0 : lengths.keys(b);
  // A sequence without queries reads nothing.
  store.visit_keys(keys, [&](int64_t b, const at::Tensor& k_b, const at::Tensor& v_b) {
    const int64_t start = lengths.start_q(b), n = lengths.len_q(b);
    if (n == 0) return;
    const at::Tensor lse_b = empty_unfilled({1, q.size(1), n}, lse.options());
    forward(sequence_view(q, start, n), k_b, v_b, sequence_view(out, start, n), lse_b);
    lse.narrow(1, start, n).copy_(lse_b[0]);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> forward_kvcache_each_sequence(
    const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& block_table, const SequenceForward& forward) {
  if (cu_seqlens_q)
    return forward_packed_kvcache_by_sequence(op, q, k_cache, v_cache, cache_seqlens, *cu_seqlens_q, k_new, v_new,
                                              block_table, forward);
  return forward_kvcache_by_sequence(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, forward);
}

}  // namespace fusedattn::ops
