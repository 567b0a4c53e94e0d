#include "gemm_attention.h"

#include <ATen/ATen.h>

#include <limits>

namespace fusedattn::ops {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The call's operands in float32, grouped for the products: query head h =
// kv_head * group + g, so q's heads view as [B, Hkv, group * rows, d] per
// block and k and v stay [B, Hkv, Nk, d] (never repeated per query head).
struct Operands {
  at::Tensor k, v;  // float32 [B, Hkv, Nk, d] and [B, Hkv, Nk, d_v]
  int64_t batch, heads_q, heads_kv, group, seqlen_q, seqlen_k;

  explicit Operands(const PreparedInputs& in)
      : k(in.k.to(at::kFloat)),
        v(in.v.to(at::kFloat)),
        batch(in.q.size(0)),
        heads_q(in.q.size(1)),
        heads_kv(in.k.size(1)),
        group(in.q.size(1) / in.k.size(1)),
        seqlen_q(in.q.size(2)),
        seqlen_k(in.k.size(2)) {}

  // Rows [row0, row0 + rows) of a [B, Hq, Nq, x] tensor in float32, as [B, Hkv, group * rows, x].
  at::Tensor grouped_rows(const at::Tensor& t, int64_t row0, int64_t rows) const {
    return t.narrow(2, row0, rows).to(at::kFloat).reshape({batch, heads_kv, group * rows, t.size(3)});
  }
  // A [B, Hkv, group * rows, x] product back as [B, Hq, rows, x].
  at::Tensor per_head(const at::Tensor& t, int64_t rows) const {
    return t.view({batch, heads_q, rows, t.size(-1)});
  }
};

// A block of query rows and the keys the band (causal, the window) lets any
// of them see, [key0, key0 + keys): the block's products skip the others.
struct Block {
  int64_t row0, rows, key0, keys;

  static Block of(const ForwardParams& p, const Operands& ops, int64_t row0, int64_t rows) {
    // Query i sees key j when i + offset - left <= j <= i + offset + right, -1 leaving a side open.
    const int64_t offset = ops.seqlen_k - ops.seqlen_q, right = p.band_right(), left = p.window_left;
    const int64_t first = left >= 0 ? std::max<int64_t>(0, row0 + offset - left) : 0;
    const int64_t end = right >= 0 ? std::min(ops.seqlen_k, row0 + rows + offset + right) : ops.seqlen_k;
    return {row0, rows, first, std::max<int64_t>(0, end - first)};
  }
  at::Tensor key_rows(const at::Tensor& t) const { return t.narrow(2, key0, keys); }
};

// The scores of a block as the softmax sees them, float32 [B, Hq, rows,
// keys]: scaled, soft-capped, attn_mask applied, the band's hidden keys -inf;
// and with a soft-cap, tanh of the capped scores (the backward's slope).
struct BlockScores {
  at::Tensor s, tanh;
};

BlockScores block_scores(const PreparedInputs& in, const Operands& ops, const at::Tensor& q_rows, const Block& blk) {
  const ForwardParams& p = in.params;
  const int64_t rows = blk.rows;
  BlockScores b;
  b.s = ops.per_head(at::matmul(q_rows, blk.key_rows(ops.k).transpose(-2, -1)), rows).mul_(p.scale);
  if (p.softcap > 0.0f) {
    b.tanh = b.s.div(p.softcap).tanh_();
    b.s = b.tanh.mul(p.softcap);
  }
  if (in.mask.defined()) {
    const at::Tensor m = in.mask.narrow(2, blk.row0, rows).narrow(3, blk.key0, blk.keys);
    if (m.scalar_type() == at::kBool)
      b.s.masked_fill_(m.logical_not(), -kInf);
    else
      b.s.add_(m);
  }
  // The band's hidden keys within the block's (Block::of's rule).
  const int64_t right = p.band_right(), left = p.window_left;
  if (right >= 0 || left >= 0) {
    const auto long_options = at::TensorOptions().dtype(at::kLong).device(b.s.device());
    const at::Tensor i =
        at::arange(blk.row0, blk.row0 + rows, long_options).unsqueeze(1) + (ops.seqlen_k - ops.seqlen_q);
    const at::Tensor j = at::arange(blk.key0, blk.key0 + blk.keys, long_options).unsqueeze(0);
    at::Tensor hidden = at::zeros({rows, blk.keys}, long_options.dtype(at::kBool));
    if (right >= 0) hidden.logical_or_(j > i + right);
    if (left >= 0) hidden.logical_or_(j < i - left);
    b.s.masked_fill_(hidden, -kInf);
  }
  return b;
}

}  // namespace

void gemm_forward(const PreparedInputs& in, const Plan& plan, const at::Tensor& out, const at::Tensor& lse) {
  const Operands ops(in);
  // The sinks as a [1, Hq, 1] logit that joins every row's normaliser.
  const at::Tensor sink = in.sinks.defined() ? in.sinks.view({1, ops.heads_q, 1}) : at::Tensor();
  for (int64_t row0 = 0; row0 < ops.seqlen_q; row0 += plan.block_m) {
    const int64_t rows = std::min<int64_t>(plan.block_m, ops.seqlen_q - row0);
    const Block blk = Block::of(in.params, ops, row0, rows);
    const at::Tensor s = block_scores(in, ops, ops.grouped_rows(in.q, row0, rows), blk).s;
    at::Tensor m = blk.keys > 0 ? s.amax(-1) : at::full({ops.batch, ops.heads_q, rows}, -kInf, s.options());
    if (sink.defined()) m = at::maximum(m, sink);
    // A row with nothing visible (m = -inf) subtracts 0: its exponentials are all 0.
    m.masked_fill_(m.isneginf(), 0.0);
    const at::Tensor e = (s - m.unsqueeze(-1)).exp_();
    at::Tensor l = e.sum(-1);
    if (sink.defined()) l.add_((sink - m).exp_());
    const at::Tensor pv =
        ops.per_head(at::matmul(e.view({ops.batch, ops.heads_kv, ops.group * rows, blk.keys}), blk.key_rows(ops.v)),
                     rows);
    // Rows with l = 0 see nothing: out 0, lse -inf.
    const at::Tensor seen = l > 0;
    out.narrow(2, row0, rows).copy_(at::where(seen.unsqueeze(-1), pv / l.unsqueeze(-1), 0.0));
    lse.narrow(2, row0, rows).copy_(at::where(seen, m + l.log(), -kInf));
  }
}

at::Tensor gemm_backward(PreparedBackward& b, const Plan& plan) {
  const PreparedInputs& in = b.fwd;
  const Operands ops(in);
  const float scale = in.params.scale;
  const at::Tensor delta = output_delta(b.grad_out, b.out);  // float32 [B, Hq, Nq]
  // lse of a row that sees nothing is -inf; as +inf it makes that row's P 0.
  const at::Tensor lse = b.lse.masked_fill(b.lse.isneginf(), kInf);
  at::Tensor grad_k = at::zeros_like(ops.k), grad_v = at::zeros_like(ops.v);
  for (int64_t row0 = 0; row0 < ops.seqlen_q; row0 += plan.block_m) {
    const int64_t rows = std::min<int64_t>(plan.block_m, ops.seqlen_q - row0);
    const at::Tensor q_rows = ops.grouped_rows(in.q, row0, rows);
    const at::Tensor do_rows = ops.grouped_rows(b.grad_out, row0, rows);
    const Block blk = Block::of(in.params, ops, row0, rows);
    const BlockScores scores = block_scores(in, ops, q_rows, blk);
    const at::Tensor p = (scores.s - lse.narrow(2, row0, rows).unsqueeze(-1)).exp_();
    const std::vector<int64_t> grouped{ops.batch, ops.heads_kv, ops.group * rows, blk.keys};
    blk.key_rows(grad_v).add_(at::matmul(p.view(grouped).transpose(-2, -1), do_rows));
    // dS = P (dP - delta), times the soft-cap's slope 1 - tanh^2.
    at::Tensor ds = ops.per_head(at::matmul(do_rows, blk.key_rows(ops.v).transpose(-2, -1)), rows)
                        .sub_(delta.narrow(2, row0, rows).unsqueeze(-1))
                        .mul_(p);
    if (scores.tanh.defined()) ds.mul_(1.0 - scores.tanh.square());
    ds = ds.view(grouped);
    b.grad_q.narrow(2, row0, rows).copy_(ops.per_head(at::matmul(ds, blk.key_rows(ops.k)).mul_(scale), rows));
    blk.key_rows(grad_k).add_(at::matmul(ds.transpose(-2, -1), q_rows));
  }
  b.grad_k.copy_(grad_k.mul_(scale));
  b.grad_v.copy_(grad_v);
  return delta;
}

}  // namespace fusedattn::ops
