// Host-side check of cpp/cuda/common/block_order.h (no GPU needed): for many
// grids and group sizes, the order visits every (pair, block) exactly once,
// keeps each group's blocks together, and never goes back to an earlier block
// rank within a group (so causal work never lengthens there). Built and run by
// .ci/check_cuda_compiles.sh; exits 1 on a failure.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../cpp/cuda/common/block_order.h"

using fusedattn::cuda::BlockOrder;
using fusedattn::cuda::GridBlock;

namespace {

int failures = 0;

void expect(bool ok, const char* what, const BlockOrder& order, unsigned index) {
  if (ok) return;
  if (failures++ < 10)
    std::printf("FAIL %s: blocks_per_pair=%u pairs=%u pairs_per_group=%u index=%u\n", what, order.blocks_per_pair,
                order.pairs, order.pairs_per_group, index);
}

template <bool Reverse>
void check(const BlockOrder& order) {
  std::vector<int> seen(order.blocks(), 0);
  unsigned previous_group = 0, previous_block = 0;
  for (unsigned i = 0; i < order.blocks(); ++i) {
    const GridBlock b = order.at<Reverse>(i);
    const bool in_range = b.pair < order.pairs && b.block < order.blocks_per_pair;
    expect(in_range, "in range", order, i);
    if (!in_range) continue;
    ++seen[size_t(b.pair) * order.blocks_per_pair + b.block];
    const unsigned group = b.pair / order.pairs_per_group;
    expect(group >= previous_group, "groups in order", order, i);
    if (i > 0 && group == previous_group)
      expect(Reverse ? b.block <= previous_block : b.block >= previous_block, "block ranks in order", order, i);
    previous_group = group;
    previous_block = b.block;
  }
  for (size_t j = 0; j < seen.size(); ++j) expect(seen[j] == 1, "each block once", order, unsigned(j));
}

}  // namespace

int main() {
  int orders = 0;
  for (unsigned blocks : {1u, 2u, 7u, 32u})
    for (unsigned pairs : {1u, 3u, 12u, 128u})
      for (unsigned group : {1u, 2u, 5u, 16u, 128u}) {
        if (group > pairs) continue;
        const BlockOrder order{blocks, pairs, group};
        check<false>(order);
        check<true>(order);
        orders += 2;
      }
  // One pair per group is the plain order: blocks fastest.
  const BlockOrder plain{5, 6, 1};
  for (unsigned i = 0; i < plain.blocks(); ++i) {
    const GridBlock b = plain.at<false>(i), c = plain.at<true>(i);
    expect(b.pair == i / 5 && b.block == i % 5, "plain order", plain, i);
    expect(c.pair == i / 5 && c.block == 4 - i % 5, "plain reversed order", plain, i);
  }
  // A group of every pair: each rank over all pairs before the next rank.
  const BlockOrder all{3, 4, 4};
  for (unsigned i = 0; i < all.blocks(); ++i)
    expect(all.at<true>(i).pair == i % 4 && all.at<true>(i).block == 2 - i / 4, "one group", all, i);
  // make_block_order without L2 grouping (no CUDA call): one pair per group;
  // a grid past 2^31 - 1 blocks is an error that names it.
  const BlockOrder made = fusedattn::cuda::make_block_order(6, 5, 1 << 20, false, "test grid");
  expect(made.pairs == 6 && made.blocks_per_pair == 5 && made.pairs_per_group == 1, "make_block_order", made, 0);
  std::string error;
  try {
    fusedattn::cuda::make_block_order(int64_t(1) << 16, int64_t(1) << 15, 1, false, "test grid");
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  expect(error.find("test grid exceeds one launch") != std::string::npos, "a grid past 2^31 throws", made, 0);
  std::printf("block_order_test: %d orders, %d failures\n", orders, failures);
  return failures == 0 ? 0 : 1;
}
