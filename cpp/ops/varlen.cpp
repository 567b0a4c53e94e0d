#include "varlen.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "checks.h"
#include "unfilled.h"

namespace fusedattn::ops {

at::Tensor check_cu_seqlens(const char* op, const at::Tensor& cu, const char* name, const at::Tensor& packed,
                            const char* packed_name, int64_t max_seqlen, const char* max_name) {
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && cu.scalar_type() == at::kInt, op, ": ", name,
              " must be int32 [B + 1], got ", cu.scalar_type(), " of shape ", cu.sizes());
  TORCH_CHECK(cu.device() == packed.device(), op, ": ", name, " must be on ", packed_name, "'s device (",
              packed.device(), "), got ", cu.device());
  const at::Tensor host =
      cu.is_cpu() && cu.is_contiguous() ? cu : empty_unfilled(cu.sizes(), cu.options().device(at::kCPU)).copy_(cu);
  const int32_t* c = host.data_ptr<int32_t>();
  const int64_t batch = host.size(0) - 1, total = packed.size(0);
  TORCH_CHECK(c[0] == 0, op, ": ", name, " must start at 0, got ", c[0]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], op, ": ", name, " must not decrease, got ", c[b], " then ", c[b + 1],
                " at sequence ", b);
    TORCH_CHECK(c[b + 1] - c[b] <= max_seqlen, op, ": sequence ", b, " has ", c[b + 1] - c[b], " rows, more than ",
                max_name, " = ", max_seqlen);
  }
  TORCH_CHECK(c[batch] == total, op, ": ", name, " must end at the ", total, " rows of ", packed_name, ", got ",
              c[batch]);
  return host;
}

VarlenLengths check_varlen_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
              ": q must be [total_q, Hq, d], k [total_k, Hkv, d] and v [total_k, Hkv, d_v] (packed sequences), "
              "got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.sizes().slice(0, 2) == v.sizes().slice(0, 2), op, ": k and v must have the same [total_k, Hkv], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.size(2) == k.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
              ": q [total_q, Hq, d] and k [total_k, Hkv, d] need the same d and Hq a multiple of Hkv, got q ",
              q.sizes(), " and k ", k.sizes());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device() && q.scalar_type() == k.scalar_type() &&
                  q.scalar_type() == v.scalar_type(),
              op, ": q, k and v must share dtype and device, got q ", q.scalar_type(), " on ", q.device(), ", k ",
              k.scalar_type(), " on ", k.device(), ", v ", v.scalar_type(), " on ", v.device());
  VarlenLengths lengths;
  lengths.cu_q = check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q, "q", max_seqlen_q, "max_seqlen_q");
  lengths.cu_k = check_cu_seqlens(op, cu_seqlens_k, "cu_seqlens_k", k, "k", max_seqlen_k, "max_seqlen_k");
  TORCH_CHECK(lengths.cu_q.size(0) == lengths.cu_k.size(0), op,
              ": cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got ",
              lengths.cu_q.size(0) - 1, " and ", lengths.cu_k.size(0) - 1);
  lengths.batch = lengths.cu_q.size(0) - 1;
  return lengths;
}

void check_varlen_outputs(const char* op, const at::Tensor& q, const at::Tensor& v, const at::Tensor& grad_out,
                          const at::Tensor& out, const at::Tensor& lse) {
  const std::vector<int64_t> out_sizes{q.size(0), q.size(1), v.size(2)};
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef(out_sizes) && out.sizes() == c10::IntArrayRef(out_sizes), op,
              ": grad_out and out must be [total_q, Hq, d_v] = ", c10::IntArrayRef(out_sizes), ", got ",
              grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0) &&
                  lse.scalar_type() == at::kFloat,
              op, ": lse must be float32 [Hq, total_q] = [", q.size(1), ", ", q.size(0), "], got ", lse.scalar_type(),
              " ", lse.sizes());
}

at::Tensor sequence_view(const at::Tensor& packed, int64_t start, int64_t n) {
  return packed.narrow(0, start, n).transpose(0, 1).unsqueeze(0);
}

at::Tensor as_one_batch(const at::Tensor& packed) { return sequence_view(packed, 0, packed.size(0)); }

at::Tensor as_packed(const at::Tensor& batch, int64_t head_dim) {
  return unpadded(batch[0].transpose(0, 1), head_dim);
}

void use_packed_gradients(PreparedBackward& b) {
  // A [1, H, total, d] view of packed [total, H, d] memory.
  use_gradients(b, [](const at::Tensor& view) {
    return as_one_batch(empty_unfilled({view.size(2), view.size(1), view.size(3)}, view.options()));
  });
}

std::tuple<at::Tensor, at::Tensor> forward_by_sequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const VarlenLengths& seq, const SequenceForward& forward) {
  at::Tensor out = empty_unfilled({q.size(0), q.size(1), v.size(2)}, q.options());
  at::Tensor lse = empty_unfilled({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  for (int64_t b = 0; b < seq.batch; ++b) {
    const int64_t sq = seq.start_q(b), nq = seq.len_q(b), sk = seq.start_k(b), nk = seq.len_k(b);
    if (nq == 0) continue;
    const at::Tensor lse_b = empty_unfilled({1, q.size(1), nq}, lse.options());  // contiguous, unlike lse's columns
    forward(sequence_view(q, sq, nq), sequence_view(k, sk, nk), sequence_view(v, sk, nk), sequence_view(out, sq, nq),
            lse_b);
    lse.narrow(1, sq, nq).copy_(lse_b[0]);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_by_sequence(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const VarlenLengths& seq, const SequenceBackward& backward) {
  at::Tensor grad_q = at::zeros(q.sizes(), q.options());
  at::Tensor grad_k = at::zeros(k.sizes(), k.options());
  at::Tensor grad_v = at::zeros(v.sizes(), v.options());
  for (int64_t b = 0; b < seq.batch; ++b) {
    const int64_t sq = seq.start_q(b), nq = seq.len_q(b), sk = seq.start_k(b), nk = seq.len_k(b);
    if (nq == 0 || nk == 0) continue;
    const auto [gq, gk, gv] =
        backward(sequence_view(grad_out, sq, nq), sequence_view(q, sq, nq), sequence_view(k, sk, nk),
                 sequence_view(v, sk, nk), sequence_view(out, sq, nq), lse.narrow(1, sq, nq).unsqueeze(0));
    sequence_view(grad_q, sq, nq).copy_(gq);
    sequence_view(grad_k, sk, nk).copy_(gk);
    sequence_view(grad_v, sk, nk).copy_(gv);
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace fusedattn::ops
