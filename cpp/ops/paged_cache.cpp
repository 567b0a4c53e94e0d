#include "paged_cache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>
#include <unordered_map>

#include "kvcache.h"

namespace fusedattn::ops {

int64_t check_cache_layout(const char* op, const at::Tensor& q, const at::Tensor& k_cache, int64_t batch,
                           const std::optional<at::Tensor>& block_table) {
  if (!block_table) {
    TORCH_CHECK(k_cache.size(0) == batch, op, ": the caches hold ", k_cache.size(0), " sequences but the call has ",
                batch, " (or pass block_table: the caches are then [pages, Hkv, page_size, d])");
    return k_cache.size(2);
  }
  const at::Tensor& table = *block_table;
  TORCH_CHECK(table.dim() == 2 && table.size(0) == batch && table.scalar_type() == at::kInt, op,
              ": block_table must be int32 [B, max_blocks] = [", batch, ", max_blocks], got ", table.scalar_type(),
              " ", table.sizes());
  TORCH_CHECK(table.device() == q.device(), op, ": block_table must be on q's device (", q.device(), "), got ",
              table.device());
  TORCH_CHECK(k_cache.size(0) > 0 && k_cache.size(2) > 0 && table.size(1) > 0, op,
              ": a paged cache needs pages of at least one position and a block_table of at least one column, got "
              "caches ", k_cache.sizes(), " and block_table ", table.sizes());
  return table.size(1) * k_cache.size(2);
}

CacheStore::CacheStore(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       int64_t batch, const std::optional<at::Tensor>& block_table)
    : op_(op), k_cache_(k_cache), v_cache_(v_cache) {
  capacity_ = check_cache_layout(op, q, k_cache, batch, block_table);
  if (!block_table) return;
  table_ = block_table->to(at::kCPU).contiguous();
  page_size_ = k_cache.size(2);
}

void CacheStore::check_pages(const std::vector<int64_t>& cached, const std::vector<int64_t>& keys) const {
  if (!paged()) return;
  const int64_t pages = k_cache_.size(0);
  std::unordered_map<int32_t, int64_t> writer;  // page -> the sequence appending into it
  for (size_t b = 0; b < keys.size(); ++b) {
    std::unordered_map<int32_t, int64_t> index_of;  // a page of this sequence -> its table column
    for (int64_t i = 0; i < pages_for(keys[b]); ++i) {
      TORCH_CHECK(page(b, i) >= 0 && page(b, i) < pages, op_, ": block_table[", b, ", ", i, "] = ", page(b, i),
                  " holds positions of sequence ", b, " but the caches have pages 0 .. ", pages - 1);
      const auto [it, added] = index_of.emplace(page(b, i), i);
      TORCH_CHECK(added, op_, ": block_table[", b, ", ", it->second, "] and block_table[", b, ", ", i,
                  "] are both page ", page(b, i), ": a sequence's positions need pages of their own");
    }
    if (keys[b] == cached[b]) continue;  // appends nothing: only reads its pages
    for (int64_t i = cached[b] / page_size_; i < pages_for(keys[b]); ++i) {
      const auto [it, added] = writer.emplace(page(b, i), b);
      TORCH_CHECK(added || it->second == int64_t(b), op_, ": sequences ", it->second, " and ", b,
                  " both append into page ", page(b, i), " (block_table)");
    }
  }
  for (size_t b = 0; b < keys.size(); ++b)
    for (int64_t i = 0; i < pages_for(keys[b]); ++i) {
      const auto it = writer.find(page(b, i));
      TORCH_CHECK(it == writer.end() || it->second == int64_t(b), op_, ": sequence ", it->second,
                  " appends into page ", page(b, i), ", which sequence ", b, " reads (block_table)");
    }
}

namespace {

// Positions of the pages one gather copies at most (a sequence longer than
// that is gathered alone): the copies stay a few MB while a decoding step's
// sequences still share one.
constexpr int64_t kGatherPositions = 1 << 14;

}  // namespace

void CacheStore::visit_keys(const std::vector<int64_t>& keys, const KeysVisitor& visit) const {
  const int64_t batch = static_cast<int64_t>(keys.size());
  if (!paged()) {
    for (int64_t b = 0; b < batch; ++b)
      visit(b, k_cache_.narrow(0, b, 1).narrow(2, 0, keys[b]), v_cache_.narrow(0, b, 1).narrow(2, 0, keys[b]));
    return;
  }
  for (int64_t begin = 0, end = 0; begin < batch; begin = end) {
    // Sequences begin .. end, their pages one after another from first[b - begin].
    std::vector<int64_t> first{0};
    for (end = begin; end < batch; ++end) {
      const int64_t pages = pages_for(keys[end]);
      if (end > begin && (first.back() + pages) * page_size_ > kGatherPositions) break;
      first.push_back(first.back() + pages);
    }
    at::Tensor index = at::zeros({std::max<int64_t>(first.back(), 1)}, at::kLong);  // page 0 when none
    int64_t* at_index = index.data_ptr<int64_t>();
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i = 0; i < first[b - begin + 1] - first[b - begin]; ++i) at_index[first[b - begin] + i] = page(b, i);
    const at::Tensor pages = index.to(k_cache_.device());
    // [pages, Hkv, S, d] -> [gathered pages, Hkv, S, d] (whole pages: a fast
    // copy) -> [Hkv, gathered pages, S, d]: a sequence's pages are adjacent,
    // so its rows view as [1, Hkv, its pages x S, d].
    const at::Tensor k_all = k_cache_.index_select(0, pages).transpose(0, 1).contiguous();
    const at::Tensor v_all = v_cache_.index_select(0, pages).transpose(0, 1).contiguous();
    auto rows_of = [&](const at::Tensor& all, int64_t b) {
      const int64_t from = first[b - begin], n = first[b - begin + 1] - from;
      return all.narrow(1, from, n).reshape({1, all.size(0), n * page_size_, all.size(3)}).narrow(2, 0, keys[b]);
    };
    for (int64_t b = begin; b < end; ++b) visit(b, rows_of(k_all, b), rows_of(v_all, b));
  }
}

void CacheStore::append(int64_t b, int64_t position, const at::Tensor& k_rows, const at::Tensor& v_rows) const {
  const int64_t n = k_rows.size(1);
  if (!paged()) {
    k_cache_[b].narrow(1, position, n).copy_(k_rows);
    v_cache_[b].narrow(1, position, n).copy_(v_rows);
    return;
  }
  for (int64_t done = 0; done < n;) {
    const auto [target, row] = slot_of(b, position + done);
    const int64_t count = std::min(page_size_ - row, n - done);
    k_cache_[target].narrow(1, row, count).copy_(k_rows.narrow(1, done, count));
    v_cache_[target].narrow(1, row, count).copy_(v_rows.narrow(1, done, count));
    done += count;
  }
}

void CacheStore::append_packed(const at::Tensor& k_new, const at::Tensor& v_new,
                               const PackedCacheLengths& lengths) const {
  const int64_t total = k_new.size(0);
  if (total == 0) return;
  at::Tensor slots = at::empty({total}, at::kLong), rows = at::empty({total}, at::kLong);
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < lengths.batch(); ++b)
    for (int64_t i = 0; i < lengths.len_q(b); ++i)
      std::tie(slot[lengths.start_q(b) + i], row[lengths.start_q(b) + i]) = slot_of(b, lengths.cached[b] + i);
  const c10::List<std::optional<at::Tensor>> at_rows{std::optional<at::Tensor>(slots.to(k_cache_.device())),
                                                     std::optional<at::Tensor>(rows.to(k_cache_.device()))};
  // [slots, rows, Hkv, d] views: (slot, row) pairs pick rows [Hkv, d] of k_new.
  k_cache_.transpose(1, 2).index_put_(at_rows, k_new);
  v_cache_.transpose(1, 2).index_put_(at_rows, v_new);
}

std::pair<at::Tensor, at::Tensor> CacheStore::gathered(const PackedCacheLengths& lengths) const {
  if (!paged()) return {k_cache_, v_cache_};
  const int64_t batch = lengths.batch();
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, pages_for(lengths.keys(b)));
  // Columns past a sequence's own pages may hold anything: page 0 stands in (read past no length).
  at::Tensor index = at::zeros({batch, longest}, at::kLong);
  int64_t* at_index = index.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < pages_for(lengths.keys(b)); ++i) at_index[b * longest + i] = page(b, i);
  const at::Tensor pages = index.flatten().to(k_cache_.device());
  // [pages, Hkv, S, d] -> [Hkv, B * longest, S, d] (one copy) -> a [B, Hkv, longest * S, d] view.
  auto gather = [&](const at::Tensor& cache) {
    const int64_t heads = cache.size(1), d = cache.size(3);
    return cache.transpose(0, 1)
        .index_select(1, pages)
        .view({heads, batch, longest * page_size_, d})
        .transpose(0, 1);
  };
  return {gather(k_cache_), gather(v_cache_)};
}

}  // namespace fusedattn::ops
