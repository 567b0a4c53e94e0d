// Host-side check of cpp/cuda/common/query_block_order.h (no GPU needed):
// for many shapes and group sizes, the order visits every (batch, head, query
// block) exactly once, keeps each group's blocks together, and gives causal
// blocks in non-increasing length within a group. Built and run by
// scripts/check_cuda_compiles.sh; exits 1 on the first failure.
#include <cstdio>
#include <vector>

#include "../../cpp/cuda/common/query_block_order.h"

using fusedattn::cuda::QueryBlock;
using fusedattn::cuda::QueryBlockOrder;

namespace {

int failures = 0;

void expect(bool ok, const char* what, unsigned m_blocks, unsigned heads_q, unsigned pairs, unsigned group,
            unsigned index) {
  if (ok) return;
  if (failures++ < 10)
    std::printf("FAIL %s: m_blocks=%u heads_q=%u pairs=%u heads_per_group=%u index=%u\n", what, m_blocks,
                heads_q, pairs, group, index);
}

template <bool IsCausal>
void check(unsigned m_blocks, unsigned heads_q, unsigned batch, unsigned heads_per_group) {
  const unsigned pairs = batch * heads_q;
  const QueryBlockOrder order{m_blocks, heads_q, pairs, heads_per_group};
  std::vector<int> seen(size_t(pairs) * m_blocks, 0);
  unsigned previous_group = 0, previous_m = 0;
  for (unsigned i = 0; i < order.blocks(); ++i) {
    const QueryBlock b = order.at<IsCausal>(i);
    const bool in_range = b.batch < batch && b.head < heads_q && b.m_block < m_blocks;
    expect(in_range, "in range", m_blocks, heads_q, pairs, heads_per_group, i);
    if (!in_range) continue;
    const unsigned pair = b.batch * heads_q + b.head;
    ++seen[size_t(pair) * m_blocks + b.m_block];
    const unsigned group = pair / heads_per_group;
    expect(group >= previous_group, "groups in order", m_blocks, heads_q, pairs, heads_per_group, i);
    // Inside a group: query block ranks never go back, so causal lengths never grow.
    if (i > 0 && group == previous_group)
      expect(IsCausal ? b.m_block <= previous_m : b.m_block >= previous_m, "longest first in a group", m_blocks,
             heads_q, pairs, heads_per_group, i);
    previous_group = group;
    previous_m = b.m_block;
  }
  for (size_t j = 0; j < seen.size(); ++j)
    expect(seen[j] == 1, "each block once", m_blocks, heads_q, pairs, heads_per_group, unsigned(j));
}

}  // namespace

int main() {
  int cases = 0;
  for (unsigned m_blocks : {1u, 2u, 7u, 32u})
    for (unsigned heads_q : {1u, 3u, 32u})
      for (unsigned batch : {1u, 4u})
        for (unsigned group : {1u, 2u, 5u, 16u, 128u}) {
          if (group > batch * heads_q) continue;
          check<false>(m_blocks, heads_q, batch, group);
          check<true>(m_blocks, heads_q, batch, group);
          cases += 2;
        }
  // One head per group is the plain order: query blocks fastest.
  const QueryBlockOrder plain{5, 3, 6, 1};
  for (unsigned i = 0; i < plain.blocks(); ++i) {
    const QueryBlock b = plain.at<false>(i), c = plain.at<true>(i);
    expect(b.batch * 3 + b.head == i / 5 && b.m_block == i % 5, "plain order", 5, 3, 6, 1, i);
    expect(c.m_block == 4 - i % 5, "plain causal order", 5, 3, 6, 1, i);
  }
  std::printf("query_block_order_test: %d orders, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
