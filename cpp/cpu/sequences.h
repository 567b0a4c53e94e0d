// The sequences of a call for the CPU kernels: a dense call's batch items, or
// a packed call's (ForwardParams::varlen, whose cu_seqlens the CPU reads as
// host memory). A task narrows the call to its sequence, so that the band
// (causal, windows) and the tiles follow that sequence's lengths, as in a
// dense call of them; lse and the backward's delta keep the call's layout
// ([B, Hq, Nq]: a packed call's [1, Hq, total_q]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fusedattn/params.h"
#include "fusedattn/sequence_rows.h"

namespace fusedattn::cpu {

// A packed call here is attention_varlen's: batch 1, no attn_mask (narrowed
// moves no mask).
inline std::vector<SequenceRows> sequences(const ForwardParams& p) {
  const bool packed = p.varlen.on();
  std::vector<SequenceRows> out;
  for (int64_t b = 0; b < (packed ? p.varlen.batch : p.shape.batch); ++b)
    out.push_back(SequenceRows::of(p, static_cast<unsigned>(b), packed));
  return out;
}

// The tasks of blocks of `block` rows (queries, or keys with over_keys) of
// `heads` heads of every sequence, ordered by sequence, head, block: a
// thread's run of tasks mostly shares one head's K and V, as a dense call's
// batch x heads x blocks order does.
class BlockTasks {
 public:
  struct Task {
    int64_t sequence, head, row0;
  };

  BlockTasks(const std::vector<SequenceRows>& seqs, int64_t heads, int64_t block, bool over_keys)
      : block_(block) {
    first_.push_back(0);
    for (const SequenceRows& s : seqs) {
      const int64_t rows = over_keys ? s.seqlen_k : s.seqlen_q;
      blocks_.push_back((rows + block - 1) / block);
      first_.push_back(first_.back() + heads * blocks_.back());
    }
  }

  int64_t count() const { return first_.back(); }

  Task operator[](int64_t task) const {
    // The last sequence whose first task is at or before `task` (sequences without rows have none).
    const int64_t s = std::upper_bound(first_.begin(), first_.end(), task) - first_.begin() - 1;
    const int64_t local = task - first_[s];
    return {s, local / blocks_[s], local % blocks_[s] * block_};
  }

 private:
  int64_t block_;
  std::vector<int64_t> first_;   // sequence s's first task; the last entry: the count
  std::vector<int64_t> blocks_;  // sequence s's blocks per head
};

// p as a dense call of sequence s alone: its lengths as the shape's, q and
// out (k and v) starting at its first query (key) row. lse is left null:
// tasks index the call's with SequenceRows::lse_index.
template <typename scalar_t>
ForwardParams narrowed(const ForwardParams& p, const SequenceRows& s) {
  ForwardParams n = p;
  n.shape.seqlen_q = s.seqlen_q;
  n.shape.seqlen_k = s.seqlen_k;
  n.q = static_cast<const scalar_t*>(p.q) + s.q0 * p.q_strides.row;
  n.out = static_cast<scalar_t*>(p.out) + s.q0 * p.out_strides.row;
  n.k = static_cast<const scalar_t*>(p.k) + s.k0 * p.k_strides.row;
  n.v = static_cast<const scalar_t*>(p.v) + s.k0 * p.v_strides.row;
  n.lse = nullptr;
  n.varlen = {};
  return n;
}

template <typename scalar_t>
BackwardParams narrowed(const BackwardParams& p, const SequenceRows& s) {
  BackwardParams n = p;
  n.fwd = narrowed<scalar_t>(p.fwd, s);
  n.grad_out = static_cast<const scalar_t*>(p.grad_out) + s.q0 * p.grad_out_strides.row;
  n.grad_q = static_cast<scalar_t*>(p.grad_q) + s.q0 * p.grad_q_strides.row;
  n.grad_k = static_cast<scalar_t*>(p.grad_k) + s.k0 * p.grad_k_strides.row;
  n.grad_v = static_cast<scalar_t*>(p.grad_v) + s.k0 * p.grad_v_strides.row;
  return n;
}

}  // namespace fusedattn::cpu
