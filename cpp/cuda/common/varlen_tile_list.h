// A packed call's work list (cuda/plan.h's VarlenWork): every tile of every
// sequence as a (sequence, tile) pair, in launch order. Host code, the
// planner's; tests/native/dq_turns_test.cu checks its orders.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "band.cuh"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

// A packed call's sequence offsets on the host: cu_seqlens_q and
// cu_seqlens_k, batch + 1 each.
struct HostSequences {
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int64_t batch = 0;
};

// One list: every tile of `tile` rows (queries, or by_keys keys) of every
// sequence, by the number of `other_tile` tiles of the other side it visits,
// longest first. last_first (the sm90 backward's deterministic mode, whose key
// blocks wait only on those launched before them: key_block_scheduler.cuh):
// a sequence at a time, each from its last tile, the sequences by their
// longest tile, longest first.
inline std::vector<int32_t> tile_list(const ForwardParams& p, const HostSequences& seqs, int tile, int other_tile,
                                      bool by_keys, bool last_first = false) {
  struct Item {
    int64_t cost;
    int32_t sequence, tile;
  };
  std::vector<Item> items;
  const bool banded = p.banded();
  for (int64_t b = 0; b < seqs.batch; ++b) {
    const int64_t nq = seqs.cu_q[b + 1] - seqs.cu_q[b], nk = seqs.cu_k[b + 1] - seqs.cu_k[b];
    const Band band = Band::of(p, nq, nk);
    const int64_t rows = by_keys ? nk : nq, others = by_keys ? nq : nk;
    const size_t first_item = items.size();
    for (int64_t first = 0, t = 0; first < rows; first += tile, ++t) {
      const int64_t last = std::min(first + tile, rows) - 1;
      int64_t begin = 0, end = others;
      if (banded) {
        begin = by_keys ? band.query_begin(first) : band.key_begin(first);
        end = by_keys ? band.query_end(last) : band.key_end(last);
      }
      const int64_t cost = end > begin ? (end + other_tile - 1) / other_tile - begin / other_tile : 0;
      items.push_back({cost, static_cast<int32_t>(b), static_cast<int32_t>(t)});
    }
    if (last_first) {  // every tile of the sequence at its longest tile's cost
      int64_t longest = 0;
      for (size_t i = first_item; i < items.size(); ++i) longest = std::max(longest, items[i].cost);
      for (size_t i = first_item; i < items.size(); ++i) items[i].cost = longest;
    }
  }
  if (last_first)
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
      return a.cost != b.cost ? a.cost > b.cost : a.sequence != b.sequence ? a.sequence < b.sequence : a.tile > b.tile;
    });
  else
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<int32_t> flat;
  flat.reserve(2 * items.size());
  for (const Item& item : items) {
    flat.push_back(item.sequence);
    flat.push_back(item.tile);
  }
  return flat;
}

}  // namespace fusedattn::cuda
