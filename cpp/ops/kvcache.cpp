#include "kvcache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>

#include "varlen.h"

namespace fusedattn::ops {

namespace {

// The checks of the caches that dense and packed queries share.
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
                             const std::optional<at::Tensor>& v_new) {
  const char* op = "fusedattn.forward_kvcache";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, Hq, Nq, d], got shape ", q.sizes());
  check_caches(op, q, k_cache, v_cache);
  TORCH_CHECK(k_cache.size(0) == q.size(0), op, ": the caches hold ", k_cache.size(0),
              " sequences but q has batch ", q.size(0));
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

// Checks that every sequence's cached positions plus n_new fit the caches and
// returns cache_seqlens on the host, contiguous.
at::Tensor checked_cache_lengths(const at::Tensor& cache_seqlens, int64_t n_new, int64_t max_len) {
  at::Tensor lengths = cache_seqlens.to(at::kCPU).contiguous();
  const int32_t* len = lengths.data_ptr<int32_t>();
  for (int64_t b = 0; b < lengths.size(0); ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + n_new <= max_len, "fusedattn.forward_kvcache: sequence ",
                b, " has ", len[b], " cached positions and ", n_new,
                " new ones, but the cache holds ", max_len);
  return lengths;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_kvcache_by_sequence(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const SequenceForward& forward) {
  const int64_t n_new = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k_new, v_new);
  const int64_t batch = q.size(0);
  const at::Tensor lengths = checked_cache_lengths(cache_seqlens, n_new, k_cache.size(2));
  const int32_t* len = lengths.data_ptr<int32_t>();

  at::Tensor out = at::empty({batch, q.size(1), q.size(2), v_cache.size(3)}, q.options());
  at::Tensor lse = at::empty({batch, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = len[b], end = len[b] + n_new;
    if (k_new) {
      k_cache[b].narrow(1, start, n_new).copy_((*k_new)[b]);
      v_cache[b].narrow(1, start, n_new).copy_((*v_new)[b]);
    }
    forward(q.narrow(0, b, 1), k_cache.narrow(0, b, 1).narrow(2, 0, end),
            v_cache.narrow(0, b, 1).narrow(2, 0, end), out.narrow(0, b, 1), lse.narrow(0, b, 1));
  }
  return {out, lse};
}

PackedCacheLengths check_packed_kvcache_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                               const at::Tensor& cu_seqlens_q, const std::optional<at::Tensor>& k_new,
                                               const std::optional<at::Tensor>& v_new) {
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
  TORCH_CHECK(k_cache.size(0) == batch, op, ": the caches hold ", k_cache.size(0), " sequences but cu_seqlens_q ",
              batch);
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
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lengths.cached[b] >= 0 && lengths.keys(b) <= k_cache.size(2), op, ": sequence ", b, " has ",
                lengths.cached[b], " cached positions and ", lengths.appends ? lengths.len_q(b) : 0,
                " new ones, but the cache holds ", k_cache.size(2));
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
    const std::optional<at::Tensor>& v_new, const SequenceForward& forward) {
  const PackedCacheLengths lengths =
      check_packed_kvcache_inputs(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new);
  if (k_new) append_packed(k_cache, v_cache, *k_new, *v_new, lengths);
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  for (int64_t b = 0; b < lengths.batch(); ++b) {
    const int64_t start = lengths.start_q(b), n = lengths.len_q(b), keys = lengths.keys(b);
    if (n == 0) continue;
    const at::Tensor lse_b = at::empty({1, q.size(1), n}, lse.options());
    forward(sequence_view(q, start, n), k_cache.narrow(0, b, 1).narrow(2, 0, keys),
            v_cache.narrow(0, b, 1).narrow(2, 0, keys), sequence_view(out, start, n), lse_b);
    lse.narrow(1, start, n).copy_(lse_b[0]);
  }
  return {out, lse};
}

void append_packed(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                   const at::Tensor& v_new, const PackedCacheLengths& lengths) {
  const int64_t total = k_new.size(0);
  if (total == 0) return;
  at::Tensor sequence = at::empty({total}, at::kLong), position = at::empty({total}, at::kLong);
  int64_t* seq = sequence.data_ptr<int64_t>();
  int64_t* pos = position.data_ptr<int64_t>();
  for (int64_t b = 0; b < lengths.batch(); ++b)
    for (int64_t i = 0; i < lengths.len_q(b); ++i) {
      seq[lengths.start_q(b) + i] = b;
      pos[lengths.start_q(b) + i] = lengths.cached[b] + i;
    }
  const c10::List<std::optional<at::Tensor>> at_rows{std::optional<at::Tensor>(sequence.to(k_cache.device())),
                                                     std::optional<at::Tensor>(position.to(k_cache.device()))};
  // [B, max_len, Hkv, d] views: (sequence, position) pairs pick rows [Hkv, d] of k_new.
  k_cache.transpose(1, 2).index_put_(at_rows, k_new);
  v_cache.transpose(1, 2).index_put_(at_rows, v_new);
}

}  // namespace fusedattn::ops
