// CPU backward, FlashAttention 2's recomputation in three parts (as in
// Triton's fused-attention tutorial), parts 2 and 3 per sequence (sequences.h):
//   1. D_i = rowsum(dO_i * O_i)
//   2. per key block j (owns dK_j, dV_j, so no two tasks write the same rows):
//        P = 2^(S - lse log2 e), dV_j += P^T dO_i, dP = dO_i V_j^T,
//        dS = P * (dP - D_i), dK_j += scale dS^T Q_i      over all i and all
//        query heads of the key head's group (GQA sums here)
//   3. per query block i: the same P and dS, dQ_i += scale dS K_j
// Parts 2 and 3 both recompute P and dP: two extra GEMMs per tile buy a race-free
// split of the work over threads without atomics or per-thread dQ copies.
// Q, K, dQ, dK rows have d entries; V, O, dO, dV rows dv (v's own head dim).
// Soft-capping scales dS by the cap's slope; a sink needs nothing here, as
// lse includes it (its own gradient is the operator layer's, sinks_gradient).
#include <ATen/Parallel.h>

#include "attention_cpu.h"
#include "row_math.h"
#include "sequences.h"
#include "tile.h"

namespace fusedattn::cpu {
namespace {

constexpr int64_t kBlockQ = kBackwardBlockQ;
constexpr int64_t kBlockK = kBackwardBlockK;

// Per-thread float32 buffers for one (query block, key block) tile.
struct TileBuffers {
  std::vector<float> q_scores, q, dout, k, kt, vt, p, dp, slope, transposed;
  TileBuffers(int64_t d, int64_t dv, bool softcap)
      : q_scores(kBlockQ * d), q(kBlockQ * d), dout(kBlockQ * dv), k(kBlockK * d),
        kt(d * kBlockK), vt(dv * kBlockK), p(kBlockQ * kBlockK), dp(kBlockQ * kBlockK),
        slope(softcap ? kBlockQ * kBlockK : 0), transposed(kBlockK * kBlockQ) {}
};

// The call's p, f and sh; parts 2 and 3 take a sequence's narrowed params
// (sp, sf: its lengths, its rows) and index lse and delta through the call's layout.
template <typename scalar_t>
struct Backward {
  const BackwardParams& p;
  const ForwardParams& f;
  const AttentionShape& sh;
  std::vector<float> delta;  // D, [B, Hq, Nq]
  std::vector<SequenceRows> seqs;

  explicit Backward(const BackwardParams& params)
      : p(params), f(params.fwd), sh(params.fwd.shape),
        delta(sh.batch * sh.heads_q * sh.seqlen_q), seqs(sequences(params.fwd)) {}

  int64_t row_index(int64_t batch, int64_t head) const {
    return (batch * sh.heads_q + head) * sh.seqlen_q;
  }

  void compute_delta() {
    const int64_t dv = sh.head_dim_v;
    at::parallel_for(0, sh.batch * sh.heads_q, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> o_buf(dv), do_buf(dv);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t batch = bh / sh.heads_q, head = bh % sh.heads_q;
        const auto* o = head_ptr<const scalar_t>(f.out, f.out_strides, batch, head);
        const auto* dout = head_ptr<const scalar_t>(p.grad_out, p.grad_out_strides, batch, head);
        for (int64_t i = 0; i < sh.seqlen_q; ++i) {
          const Matrix O = view_rows(o, f.out_strides.row, i, 1, dv, o_buf);
          const Matrix dO = view_rows(dout, p.grad_out_strides.row, i, 1, dv, do_buf);
          delta[row_index(batch, head) + i] = dot(O.data, dO.data, dv);
        }
      }
    });
  }

  // Recomputes P for tile t into buf.p and dS (with respect to the scores
  // before soft-capping) into buf.dp, from
  // Qs = scale log2(e) Q, K^T, dO and V^T. Returns false when attn_mask hides
  // the whole tile.
  bool probabilities_and_grad(const ForwardParams& sf, const SequenceRows& seq, int64_t head, const Tile& t,
                              Matrix Qs, Matrix Kt, Matrix dO, Matrix Vt, TileBuffers& buf) {
    const int64_t batch = seq.batch;
    const MaskTile mask_tile = classify_mask_tile<scalar_t>(sf.mask, batch, head, t);
    if (mask_tile == MaskTile::Hidden) return false;
    matmul(t.rows, t.cols, sh.head_dim, Qs, Kt, buf.p.data(), kBlockK, /*accumulate=*/false);
    const bool softcap = f.softcap > 0.0f;
    if (softcap)
      for (int64_t r = 0; r < t.rows; ++r)
        softcap_row(buf.p.data() + r * kBlockK, t.cols, f.softcap * kLog2e, buf.slope.data() + r * kBlockK);
    if (tile_needs_masking(sf, t, mask_tile))
      mask_scores<scalar_t>(buf.p.data(), kBlockK, sf, batch, head, t, mask_tile);
    matmul(t.rows, t.cols, sh.head_dim_v, dO, Vt, buf.dp.data(), kBlockK, /*accumulate=*/false);

    const float* lse = f.lse + seq.lse_index(sh, head, t.row0);
    const float* D = delta.data() + seq.lse_index(sh, head, t.row0);
    for (int64_t r = 0; r < t.rows; ++r) {
      float* p_row = buf.p.data() + r * kBlockK;
      if (lse[r] == kNegInf) {
        // A fully masked row has out = 0 and no gradient.
        std::fill(p_row, p_row + t.cols, 0.0f);
      } else {
        exp2_shifted(p_row, t.cols, lse[r] * kLog2e);
      }
      softmax_grad_row(buf.dp.data() + r * kBlockK, p_row, t.cols, D[r]);
      // Through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2.
      if (softcap) multiply_row(buf.dp.data() + r * kBlockK, buf.slope.data() + r * kBlockK, t.cols);
    }
    return true;
  }

  // Part 2: dK and dV for one block of keys of one key/value head.
  void key_block(const SequenceRows& seq, int64_t head_kv, int64_t col0, TileBuffers& buf,
                 std::vector<float>& dk, std::vector<float>& dv) {
    const BackwardParams sp = narrowed<scalar_t>(p, seq);
    const ForwardParams& sf = sp.fwd;
    const int64_t batch = seq.batch, d = sh.head_dim, d_v = sh.head_dim_v;
    const int64_t cols = std::min(kBlockK, seq.seqlen_k - col0);
    const Matrix Kt = copy_rows_transposed(head_ptr<const scalar_t>(sf.k, sf.k_strides, batch, head_kv),
                                           sf.k_strides.row, col0, cols, d, kBlockK, buf.kt);
    const Matrix Vt = copy_rows_transposed(head_ptr<const scalar_t>(sf.v, sf.v_strides, batch, head_kv),
                                           sf.v_strides.row, col0, cols, d_v, kBlockK, buf.vt);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);

    // Queries outside the band (is_causal, the window) see none of these keys.
    const auto [first_row, row_end] = visible_queries(sf, col0, cols);
    for (int64_t g = 0; g < sh.group_size(); ++g) {
      const int64_t head = head_kv * sh.group_size() + g;
      const auto* q = head_ptr<const scalar_t>(sf.q, sf.q_strides, batch, head);
      const auto* dout = head_ptr<const scalar_t>(sp.grad_out, sp.grad_out_strides, batch, head);
      for (int64_t row0 = first_row / kBlockQ * kBlockQ; row0 < row_end; row0 += kBlockQ) {
        const Tile t{row0, std::min(kBlockQ, seq.seqlen_q - row0), col0, cols};
        const Matrix Qs = copy_rows(q, sf.q_strides.row, row0, t.rows, d, f.scale * kLog2e, buf.q_scores);
        const Matrix dO = view_rows(dout, sp.grad_out_strides.row, row0, t.rows, d_v, buf.dout);
        if (!probabilities_and_grad(sf, seq, head, t, Qs, Kt, dO, Vt, buf)) continue;
        const Matrix Q = view_rows(q, sf.q_strides.row, row0, t.rows, d, buf.q);
        const Matrix Pt = transpose(buf.p.data(), t.rows, cols, kBlockK, buf.transposed, kBlockQ);
        matmul(cols, d_v, t.rows, Pt, dO, dv.data(), d_v, /*accumulate=*/true);
        const Matrix dSt = transpose(buf.dp.data(), t.rows, cols, kBlockK, buf.transposed, kBlockQ);
        matmul(cols, d, t.rows, dSt, Q, dk.data(), d, /*accumulate=*/true);
      }
    }
    scale_row(dk.data(), cols * d, f.scale);  // dK = scale dS^T Q
    store_rows(head_ptr<scalar_t>(sp.grad_k, sp.grad_k_strides, batch, head_kv),
               sp.grad_k_strides.row, col0, cols, d, dk.data());
    store_rows(head_ptr<scalar_t>(sp.grad_v, sp.grad_v_strides, batch, head_kv),
               sp.grad_v_strides.row, col0, cols, d_v, dv.data());
  }

  // Part 3: dQ for one block of queries of one query head.
  void query_block(const SequenceRows& seq, int64_t head, int64_t row0, TileBuffers& buf,
                   std::vector<float>& dq) {
    const BackwardParams sp = narrowed<scalar_t>(p, seq);
    const ForwardParams& sf = sp.fwd;
    const int64_t batch = seq.batch, d = sh.head_dim;
    const int64_t rows = std::min(kBlockQ, seq.seqlen_q - row0);
    const int64_t head_kv = head / sh.group_size();
    const Matrix Qs = copy_rows(head_ptr<const scalar_t>(sf.q, sf.q_strides, batch, head),
                                sf.q_strides.row, row0, rows, d, f.scale * kLog2e, buf.q_scores);
    const Matrix dO = view_rows(head_ptr<const scalar_t>(sp.grad_out, sp.grad_out_strides, batch, head),
                                sp.grad_out_strides.row, row0, rows, sh.head_dim_v, buf.dout);
    const auto* k = head_ptr<const scalar_t>(sf.k, sf.k_strides, batch, head_kv);
    const auto* v = head_ptr<const scalar_t>(sf.v, sf.v_strides, batch, head_kv);
    std::fill(dq.begin(), dq.end(), 0.0f);

    const int64_t key_end = visible_key_end(sf, row0, rows);
    for (int64_t col0 = visible_key_begin(sf, row0); col0 < key_end; col0 += kBlockK) {
      const Tile t{row0, rows, col0, std::min(kBlockK, key_end - col0)};
      const Matrix Kt = copy_rows_transposed(k, sf.k_strides.row, col0, t.cols, d, kBlockK, buf.kt);
      const Matrix Vt = copy_rows_transposed(v, sf.v_strides.row, col0, t.cols, sh.head_dim_v, kBlockK, buf.vt);
      if (!probabilities_and_grad(sf, seq, head, t, Qs, Kt, dO, Vt, buf)) continue;
      const Matrix K = view_rows(k, sf.k_strides.row, col0, t.cols, d, buf.k);
      matmul(rows, d, t.cols, {buf.dp.data(), kBlockK}, K, dq.data(), d, /*accumulate=*/true);
    }
    scale_row(dq.data(), rows * d, f.scale);  // dQ = scale dS K
    store_rows(head_ptr<scalar_t>(sp.grad_q, sp.grad_q_strides, batch, head), sp.grad_q_strides.row,
               row0, rows, d, dq.data());
  }

  void run() {
    const int64_t d = sh.head_dim, d_v = sh.head_dim_v;
    compute_delta();

    const BlockTasks key_tasks(seqs, sh.heads_kv, kBlockK, /*over_keys=*/true);
    at::parallel_for(0, key_tasks.count(), 1, [&](int64_t begin, int64_t end) {
      TileBuffers buf(d, d_v, f.softcap > 0.0f);
      std::vector<float> dk(kBlockK * d), dv(kBlockK * d_v);
      for (int64_t index = begin; index < end; ++index) {
        const BlockTasks::Task task = key_tasks[index];
        key_block(seqs[task.sequence], task.head, task.row0, buf, dk, dv);
      }
    });

    const BlockTasks query_tasks(seqs, sh.heads_q, kBlockQ, /*over_keys=*/false);
    at::parallel_for(0, query_tasks.count(), 1, [&](int64_t begin, int64_t end) {
      TileBuffers buf(d, d_v, f.softcap > 0.0f);
      std::vector<float> dq(kBlockQ * d);
      for (int64_t index = begin; index < end; ++index) {
        const BlockTasks::Task task = query_tasks[index];
        query_block(seqs[task.sequence], task.head, task.row0, buf, dq);
      }
    });
  }
};

}  // namespace

void backward(const BackwardParams& p) {
  dispatch_dtype(p.fwd.dtype, [&](auto dtype) { Backward<scalar_of<dtype.value>>(p).run(); });
}

}  // namespace fusedattn::cpu
