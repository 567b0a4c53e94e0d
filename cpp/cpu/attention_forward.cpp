// CPU forward: one task per (sequence, query head, block of kBlockQ queries),
// streaming blocks of kBlockK keys with the online softmax:
//   S   = (scale * log2 e) Q K^T          (base-2 scores, GEMM)
//   m'  = max(m, rowmax S);  P = 2^(S - m')
//   l   = 2^(m - m') l + rowsum P;  acc = 2^(m - m') acc + P V   (GEMM)
//   out = acc / l,  lse = (m + log2 l) ln 2
// Soft-capping applies to S before the masks; a sink joins m and l at the end.
// Q and K rows have d entries, V, acc and out rows dv (v's own head dim).
#include <ATen/Parallel.h>

#include "attention_cpu.h"
#include "row_math.h"
#include "sequences.h"
#include "tile.h"

namespace fusedattn::cpu {
namespace {

constexpr int64_t kBlockQ = kForwardBlockQ;
constexpr int64_t kBlockK = kForwardBlockK;
// Blocks of at most this many queries compute S with dot products (see below).
constexpr int64_t kDotRows = 16;

template <typename scalar_t>
void forward_typed(const ForwardParams& call) {
  const AttentionShape& sh = call.shape;
  const int64_t d = sh.head_dim, dv = sh.head_dim_v;
  const float score_scale = call.scale * kLog2e;
  const std::vector<SequenceRows> seqs = sequences(call);
  const BlockTasks tasks(seqs, sh.heads_q, kBlockQ, /*over_keys=*/false);

  // Buffers hold at most max_rows query rows: decoding (Nq = 1) then clears
  // a few KB per task instead of a 256 x 256 tile.
  int64_t longest = 0;
  for (const SequenceRows& s : seqs) longest = std::max(longest, s.seqlen_q);
  const int64_t max_rows = std::min(kBlockQ, longest);
  at::parallel_for(0, tasks.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_buf(max_rows * d), kt_buf(d * kBlockK), v_buf(kBlockK * dv);
    std::vector<float> s(max_rows * kBlockK), acc(max_rows * dv), m_i(max_rows), l_i(max_rows);

    for (int64_t index = begin; index < end; ++index) {
      const BlockTasks::Task task = tasks[index];
      const SequenceRows& seq = seqs[task.sequence];
      const ForwardParams p = narrowed<scalar_t>(call, seq);
      const int64_t batch = seq.batch, head = task.head, row0 = task.row0;
      const int64_t head_kv = head / sh.group_size();
      const int64_t rows = std::min(kBlockQ, seq.seqlen_q - row0);

      const auto* q = head_ptr<const scalar_t>(p.q, p.q_strides, batch, head);
      const auto* k = head_ptr<const scalar_t>(p.k, p.k_strides, batch, head_kv);
      const auto* v = head_ptr<const scalar_t>(p.v, p.v_strides, batch, head_kv);
      // The score scale is folded into Q once: S = (scale log2 e Q) K^T.
      const Matrix Q = copy_rows(q, p.q_strides.row, row0, rows, d, score_scale, q_buf);

      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m_i.begin(), m_i.end(), kNegInf);
      std::fill(l_i.begin(), l_i.end(), 0.0f);

      const int64_t key_end = visible_key_end(p, row0, rows);
      for (int64_t col0 = visible_key_begin(p, row0); col0 < key_end; col0 += kBlockK) {
        const Tile t{row0, rows, col0, std::min(kBlockK, key_end - col0)};
        const MaskTile mask_tile = classify_mask_tile<scalar_t>(p.mask, batch, head, t);
        if (mask_tile == MaskTile::Hidden) continue;

        if (rows <= kDotRows) {
          // Decoding-sized blocks: dot products against K's rows as stored
          // cost less than transposing the K tile for a GEMM.
          const Matrix K = view_rows(k, p.k_strides.row, col0, t.cols, d, kt_buf);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < t.cols; ++c)
              s[r * kBlockK + c] = dot(Q.data + r * Q.ld, K.data + c * K.ld, d);
        } else {
          const Matrix Kt = copy_rows_transposed(k, p.k_strides.row, col0, t.cols, d, kBlockK, kt_buf);
          matmul(rows, t.cols, d, Q, Kt, s.data(), kBlockK, /*accumulate=*/false);
        }
        if (p.softcap > 0.0f)  // before the masks, in base 2 like the scores
          for (int64_t r = 0; r < rows; ++r) softcap_row(s.data() + r * kBlockK, t.cols, p.softcap * kLog2e);
        if (tile_needs_masking(p, t, mask_tile)) mask_scores<scalar_t>(s.data(), kBlockK, p, batch, head, t, mask_tile);

        for (int64_t r = 0; r < rows; ++r) {
          float* s_row = s.data() + r * kBlockK;
          const float m_new = std::max(m_i[r], row_max(s_row, t.cols));
          // A row with nothing visible yet keeps m = -inf; shifting by 0 then
          // turns its -inf scores into zeros instead of NaN.
          const float shift = m_new == kNegInf ? 0.0f : m_new;
          const float rescale = std::exp2(m_i[r] - shift);
          l_i[r] = l_i[r] * rescale + exp2_shifted(s_row, t.cols, shift);
          if (rescale != 1.0f) scale_row(acc.data() + r * dv, dv, rescale);
          m_i[r] = m_new;
        }
        const Matrix V = view_rows(v, p.v_strides.row, col0, t.cols, dv, v_buf);
        matmul(rows, dv, t.cols, {s.data(), kBlockK}, V, acc.data(), dv, /*accumulate=*/true);
      }

      // The sink joins each row's normaliser last. Rows that see nothing
      // (l = 0) give out = 0 and lse = -inf (with a sink: lse = sink).
      float* lse = call.lse + seq.lse_index(sh, head, row0);
      for (int64_t r = 0; r < rows; ++r) {
        const float acc_scale = p.sinks ? add_valueless_logit(p.sinks[head] * kLog2e, m_i[r], l_i[r]) : 1.0f;
        const bool empty = l_i[r] == 0.0f;
        lse[r] = empty ? kNegInf : (m_i[r] + std::log2(l_i[r])) * kLn2;
        l_i[r] = empty ? 0.0f : acc_scale / l_i[r];  // reused as the output row scale
      }
      store_rows(head_ptr<scalar_t>(p.out, p.out_strides, batch, head), p.out_strides.row, row0,
                 rows, dv, acc.data(), l_i.data());
    }
  });
}

}  // namespace

void forward(const ForwardParams& p) {
  dispatch_dtype(p.dtype, [&](auto dtype) { forward_typed<scalar_of<dtype.value>>(p); });
}

}  // namespace fusedattn::cpu
