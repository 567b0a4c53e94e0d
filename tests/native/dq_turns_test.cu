// Host-side check of the sm90 backward's deterministic order (no GPU needed;
// cpp/cuda/common/key_block_scheduler.cuh and varlen_tile_list.h): a key
// block's turn at a query tile must count exactly the later key blocks that
// visit it, or a block waits for a turn that never comes; and a block may
// wait only on blocks launched before it. For many lengths, bands and tiles:
//   - the query blocks a key block visits are those where one of the
//     blocks' queries sees one of its keys (brute force over the band);
//   - the key blocks visiting a query block are a run that ends at
//     last_visiting_key_block, so the turns there are 0, 1, ... in order;
//   - packed sequences' turn tiles are apart and within the counters;
//   - the work list in last-first order holds each tile once, a sequence at
//     a time, each from its last tile (and longest-first holds each once).
// Built and run by .ci/check_cuda_compiles.sh; exits 1 on a failure.
#include <cstdio>
#include <set>
#include <vector>

#include "../../cpp/cuda/common/key_block_scheduler.cuh"
#include "../../cpp/cuda/common/varlen_tile_list.h"

using namespace fusedattn;
using namespace fusedattn::cuda;

namespace {

int failures = 0;
int checked = 0;

void expect(bool ok, const char* what, int64_t nq, int64_t nk, int64_t left, int64_t right, bool causal, int bm,
            int bn, int64_t at) {
  if (ok) return;
  if (failures++ < 10)
    std::printf("FAIL %s: Nq=%lld Nk=%lld window=(%lld, %lld) causal=%d block_m=%d block_n=%d at %lld\n", what,
                (long long)nq, (long long)nk, (long long)left, (long long)right, int(causal), bm, bn, (long long)at);
}

ForwardParams band_params(int64_t nq, int64_t nk, int64_t left, int64_t right, bool causal) {
  ForwardParams f;
  f.shape.seqlen_q = nq;
  f.shape.seqlen_k = nk;
  f.window_left = left;
  f.window_right = right;
  f.is_causal = causal;
  return f;
}

template <bool Banded>
void check_turns(int64_t nq, int64_t nk, int64_t left, int64_t right, bool causal, int bm, int bn) {
  const ForwardParams f = band_params(nq, nk, left, right, causal);
  const Band band = Band::of(f, nq, nk);
  const int64_t key_blocks = (nk + bn - 1) / bn, query_blocks = (nq + bm - 1) / bm;
  std::vector<std::vector<int64_t>> visitors(query_blocks);
  for (int64_t n = 0; n < key_blocks; ++n) {
    const int64_t key0 = n * bn, keys = std::min<int64_t>(bn, nk - key0);
    const VisitedQueryBlocks visited = visited_query_blocks<Banded>(band, key0, keys, bm);
    for (int64_t m = 0; m < query_blocks; ++m) {
      bool sees = false;
      for (int64_t i = m * bm; i < std::min<int64_t>(nq, (m + 1) * bm) && !sees; ++i)
        for (int64_t j = key0; j < key0 + keys && !sees; ++j) sees = !Banded || band.sees(i, j);
      const bool walked = visited.count > 0 && m * bm >= visited.m_begin && m < visited.m_begin / bm + visited.count;
      expect(walked == sees, "a key block visits the query blocks that see its keys", nq, nk, left, right, causal, bm,
             bn, n * 1000 + m);
      if (walked) visitors[m].push_back(n);
    }
    expect(visited.count == 0 || visited.m_begin % bm == 0, "visits start on a query block", nq, nk, left, right,
           causal, bm, bn, n);
  }
  for (int64_t m = 0; m < query_blocks; ++m) {
    const std::vector<int64_t>& v = visitors[m];
    if (v.empty()) continue;
    const int64_t last = last_visiting_key_block<Banded>(band, m * bm, bm, bn);
    expect(v.back() == last, "the last visitor is last_visiting_key_block", nq, nk, left, right, causal, bm, bn, m);
    expect(v.back() - v.front() + 1 == int64_t(v.size()), "a query block's visitors are a run", nq, nk, left, right,
           causal, bm, bn, m);
    ++checked;
  }
}

// Packed sequences: each sequence's query tiles map to distinct counters of
// their head, below dq_turn_tiles_per_head.
void check_packed_tiles(const std::vector<int32_t>& lengths, int bm) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  ForwardParams f;
  f.shape.seqlen_q = cu.back();
  f.varlen.cu_seqlens_q = cu.data();  // only tested for null
  f.varlen.batch = static_cast<int64_t>(lengths.size());
  const int64_t per_head = dq_turn_tiles_per_head(f, bm);
  std::set<int64_t> seen;
  bool apart = true, inside = true;
  for (size_t b = 0; b < lengths.size(); ++b)
    for (int64_t m0 = 0; m0 < lengths[b]; m0 += bm) {
      const int64_t tile = dq_turn_tile(f, int64_t(b), cu[b], m0, bm);
      apart &= seen.insert(tile).second;
      inside &= tile >= 0 && tile < per_head;
    }
  expect(apart, "packed turn tiles apart", cu.back(), 0, 0, 0, false, bm, 0, int64_t(lengths.size()));
  expect(inside, "packed turn tiles inside the counters", cu.back(), 0, 0, 0, false, bm, 0, int64_t(lengths.size()));
}

void check_work_list(const std::vector<int32_t>& lengths, int64_t left, int64_t right, bool causal, int bn, int bm) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  const ForwardParams f = band_params(cu.back(), cu.back(), left, right, causal);
  const HostSequences seqs{cu.data(), cu.data(), static_cast<int64_t>(lengths.size())};
  for (bool last_first : {false, true}) {
    const std::vector<int32_t> list = tile_list(f, seqs, bn, bm, /*by_keys=*/true, last_first);
    std::set<std::pair<int32_t, int32_t>> seen;
    std::vector<int32_t> previous(lengths.size(), -1);
    std::set<int32_t> finished;  // sequences whose tiles the list has left
    bool once = true, in_order = true;
    for (size_t i = 0; i < list.size(); i += 2) {
      const int32_t b = list[i], t = list[i + 1];
      once &= seen.insert({b, t}).second;
      if (last_first) {
        in_order &= (previous[b] < 0 || t == previous[b] - 1) && !finished.count(b);
        if (i > 0 && list[i - 2] != b) finished.insert(list[i - 2]);
      }
      previous[b] = t;
    }
    int64_t tiles = 0;
    for (int32_t n : lengths) tiles += (n + bn - 1) / bn;
    expect(once && int64_t(seen.size()) == tiles, "the work list holds each tile once", cu.back(), cu.back(), left,
           right, causal, bm, bn, last_first);
    for (size_t b = 0; b < lengths.size() && last_first; ++b)
      in_order &= lengths[b] == 0 || previous[b] == 0;
    expect(in_order, "last-first lists each sequence's tiles from its last", cu.back(), cu.back(), left, right,
           causal, bm, bn, 0);
  }
}

void expect_rotation(bool ok, const char* what, int blocks, int steps, int max_blocks) {
  if (ok) return;
  if (failures++ < 10)
    std::printf("FAIL %s: blocks=%d steps=%d max_blocks=%d\n", what, blocks, steps, max_blocks);
}

// Rotated walks (unbanded, DqRotation) of `blocks` key blocks over `steps`
// steps, rotated up to `max_blocks` blocks:
//   - at every step the blocks' turns are 0 .. blocks - 1, each once;
//   - launched last first, with room for all of them where rotated and for
//     one at a time where not, every walk ends: no block waits on a block
//     that cannot start;
//   - rotated, started together, an add seen a tick later, the walks take
//     `steps` ticks: no block waits.
// simulate_rotation: the ticks the walks take, or -1 on a hang.
int64_t simulate_rotation(int blocks, int steps, int max_blocks, int room) {
  std::vector<DqRotation> rot;
  for (int n = 0; n < blocks; ++n) rot.push_back(DqRotation::of(n, blocks, steps, max_blocks));
  auto step_of = [&](int n, int s) { return rot[n].step(s, steps); };
  std::vector<int> counter(steps, 0), done(blocks, 0), resident;
  int next = blocks - 1;  // launched last first
  int64_t ticks = 0;
  for (int finished = 0; finished < blocks; ++ticks) {
    while (int(resident.size()) < room && next >= 0) resident.push_back(next--);
    std::vector<int> adding;
    for (int n : resident)
      if (counter[step_of(n, done[n])] == rot[n].turn(step_of(n, done[n]))) adding.push_back(n);
    if (adding.empty()) return -1;  // every resident block waits: a hang
    for (int n : adding) ++counter[step_of(n, done[n]++)];
    for (size_t i = 0; i < resident.size();)
      if (done[resident[i]] == steps) {
        resident.erase(resident.begin() + i);
        ++finished;
      } else {
        ++i;
      }
  }
  return ticks;
}

void check_rotation(int blocks, int steps, int max_blocks) {
  bool permutation = true;
  for (int f = 0; f < steps; ++f) {
    std::vector<int> seen(blocks, 0);
    for (int n = 0; n < blocks; ++n) {
      const int turn = DqRotation::of(n, blocks, steps, max_blocks).turn(f);
      if (turn < 0 || turn >= blocks || seen[turn]++) permutation = false;
    }
  }
  const bool rotated = DqRotation::of(0, blocks, steps, max_blocks).spacing > 0;
  expect_rotation(permutation, "a step's turns are 0 .. blocks - 1", blocks, steps, max_blocks);
  expect_rotation(simulate_rotation(blocks, steps, max_blocks, rotated ? blocks : 1) > 0,
                  "the walks end with room for the blocks that wait on one another", blocks, steps, max_blocks);
  expect_rotation(rotated == (blocks <= max_blocks && steps >= blocks),
                  "rotated where the blocks fit and have the steps", blocks, steps, max_blocks);
  if (rotated)
    expect_rotation(simulate_rotation(blocks, steps, max_blocks, blocks) == steps, "rotated walks in step never wait",
                    blocks, steps, max_blocks);
  ++checked;
}

// Under a band, a pair's key blocks launched from block 0 (longest_first_ordered)
// with room for all of them, started together, an add seen a tick later:
// every walk ends (a block waits only on its pair's), and with as many
// queries as keys under causal none waits (block j + 1 reaches a query tile
// before block j).
template <bool Banded>
void check_longest_first(int64_t nq, int64_t nk, int64_t left, int64_t right, bool causal, int bm, int bn) {
  const ForwardParams f = band_params(nq, nk, left, right, causal);
  const Band band = Band::of(f, nq, nk);
  const int64_t blocks = (nk + bn - 1) / bn, query_blocks = (nq + bm - 1) / bm;
  std::vector<VisitedQueryBlocks> walks;
  int64_t longest = 0;
  for (int64_t n = 0; n < blocks; ++n) {
    walks.push_back(visited_query_blocks<Banded>(band, n * bn, std::min<int64_t>(bn, nk - n * bn), bm));
    longest = std::max(longest, walks.back().count);
  }
  std::vector<int64_t> counter(query_blocks, 0), done(blocks, 0);
  int64_t ticks = 0, left_to_do = 0;
  for (const VisitedQueryBlocks& w : walks) left_to_do += w.count;
  bool hang = false;
  for (; left_to_do > 0 && !hang; ++ticks) {
    std::vector<int64_t> adding;
    for (int64_t n = 0; n < blocks; ++n) {
      if (done[n] == walks[n].count) continue;
      const int64_t m = walks[n].m_begin / bm + done[n];
      if (counter[m] == last_visiting_key_block<Banded>(band, m * bm, bm, bn) - n) adding.push_back(n);
    }
    hang = adding.empty();
    for (int64_t n : adding) ++counter[walks[n].m_begin / bm + done[n]++], --left_to_do;
  }
  expect(!hang, "longest-first walks end with room for the pair", nq, nk, left, right, causal, bm, bn, 0);
  if (causal && nq == nk && left < 0 && right < 0)
    expect(ticks == longest, "longest-first causal walks in step never wait", nq, nk, left, right, causal, bm, bn,
           ticks);
}

}  // namespace

int main() {
  const int64_t lengths[] = {1, 7, 63, 64, 65, 127, 200, 333};
  const int64_t windows[][2] = {{-1, -1}, {0, 0}, {40, 7}, {100, 0}, {-1, 30}, {5, -1}, {300, 300}};
  for (int64_t nq : lengths)
    for (int64_t nk : lengths)
      for (auto& w : windows)
        for (bool causal : {false, true})
          for (auto [bm, bn] : {std::pair{64, 128}, std::pair{128, 128}, std::pair{64, 64}}) {
            const ForwardParams f = band_params(nq, nk, w[0], w[1], causal);
            if (f.banded()) {
              check_turns<true>(nq, nk, w[0], w[1], causal, bm, bn);
              check_longest_first<true>(nq, nk, w[0], w[1], causal, bm, bn);
            } else {
              check_turns<false>(nq, nk, w[0], w[1], causal, bm, bn);
            }
          }
  for (int bm : {64, 128}) {
    check_packed_tiles({5, 64, 1, 130, 0, 63, 65, 200}, bm);
    check_packed_tiles({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, bm);
    check_packed_tiles({128, 128, 127, 129}, bm);
  }
  for (auto& w : windows)
    for (bool causal : {false, true}) {
      check_work_list({300, 5, 1000, 0, 129, 64}, w[0], w[1], causal, 128, 64);
      check_work_list({77, 600, 600, 2}, w[0], w[1], causal, 64, 64);
    }
  for (int blocks : {1, 2, 3, 7, 16, 33, 64, 100})
    for (int steps : {1, 2, 5, 16, 31, 32, 64, 97, 256})
      for (int max_blocks : {0, 16, 32}) check_rotation(blocks, steps, max_blocks);
  if (failures > 0) {
    std::printf("dq_turns_test: %d failure(s)\n", failures);
    return 1;
  }
  std::printf("dq_turns_test: ok (%d query blocks' turns checked)\n", checked);
  return 0;
}
