// Where forward_kvcache reads and appends a sequence's keys and values: a
// cache of its own per sequence ([B, Hkv, max_len, d]), or pages shared by
// all of them through a block table (FlashAttention's block_table): k_cache
// [pages, Hkv, page_size, d], and sequence b's position p at row
// p % page_size of page block_table[b, p / page_size].
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace fusedattn::ops {

struct PackedCacheLengths;

// Checks that the caches hold `batch` sequences, or block_table's shape,
// dtype and device (int32 [batch, max_blocks] on q's device; its entries are
// not read); returns the positions a sequence can hold.
int64_t check_cache_layout(const char* op, const at::Tensor& q, const at::Tensor& k_cache, int64_t batch,
                           const std::optional<at::Tensor>& block_table);

class CacheStore {
 public:
  // Checks block_table (int32 [B, max_blocks] on q's device; read on the
  // host) against the caches; without it the caches must hold B sequences.
  CacheStore(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t batch,
             const std::optional<at::Tensor>& block_table);

  bool paged() const { return table_.defined(); }
  // The positions a sequence can hold.
  int64_t capacity() const { return capacity_; }
  // Checks that the pages of sequence b's first keys[b] positions exist and
  // are distinct, and that a page it appends into (positions cached[b] ..
  // keys[b]) is read or written by no other sequence of the call (nothing to
  // check unpaged).
  void check_pages(const std::vector<int64_t>& cached, const std::vector<int64_t>& keys) const;
  // Calls visit(b, k_b, v_b) for every sequence b in order, with its first
  // keys[b] positions, [1, Hkv, keys[b], d] and [1, Hkv, keys[b], d_v]:
  // views of its cache, or of its pages gathered with those of the sequences
  // beside it, one copy per cache for up to kGatherPositions positions.
  using KeysVisitor = std::function<void(int64_t b, const at::Tensor& k, const at::Tensor& v)>;
  void visit_keys(const std::vector<int64_t>& keys, const KeysVisitor& visit) const;
  // Writes k_rows [Hkv, n, d] and v_rows [Hkv, n, d_v] at positions
  // position .. position + n of sequence b (in place).
  void append(int64_t b, int64_t position, const at::Tensor& k_rows, const at::Tensor& v_rows) const;
  // Packed queries' new keys: row cu_q[b] + i of k_new [total_q, Hkv, d] and
  // v_new [total_q, Hkv, d_v] at position cached[b] + i of sequence b, all
  // in one indexed copy per cache (in place).
  void append_packed(const at::Tensor& k_new, const at::Tensor& v_new, const PackedCacheLengths& lengths) const;
  // Every sequence's pages (those of its lengths.keys(b) positions), in
  // order, as caches of its own: [B, Hkv, P x page_size, d] and [.., d_v]
  // with rows contiguous per sequence, P the longest sequence's pages (new
  // tensors, viewed); unpaged, the caches themselves.
  std::pair<at::Tensor, at::Tensor> gathered(const PackedCacheLengths& lengths) const;

 private:
  const char* op_;
  at::Tensor k_cache_, v_cache_;
  at::Tensor table_;  // int32 [B, max_blocks] on the host, contiguous; undefined unpaged
  int64_t page_size_ = 0, capacity_ = 0;
  int64_t pages_for(int64_t positions) const { return (positions + page_size_ - 1) / page_size_; }
  int32_t page(int64_t b, int64_t index) const { return table_.data_ptr<int32_t>()[b * table_.size(1) + index]; }
  // The cache's first index (the sequence, or its page) and row that hold position p of sequence b.
  std::pair<int64_t, int64_t> slot_of(int64_t b, int64_t p) const {
    return paged() ? std::pair<int64_t, int64_t>{page(b, p / page_size_), p % page_size_}
                   : std::pair<int64_t, int64_t>{b, p};
  }
};

}  // namespace fusedattn::ops
