// attention_varlen's device-independent part: the checks of packed
// [total, H, d] operands and their cu_seqlens, and a sequence's rows as the
// [1, H, n, d] view every dense kernel takes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <tuple>

namespace fusedattn::ops {

// cu_seqlens_q and cu_seqlens_k on the host, int32 contiguous [B + 1].
struct VarlenLengths {
  at::Tensor cu_q, cu_k;
  int64_t batch = 0;
  int64_t start_q(int64_t b) const { return cu_q.data_ptr<int32_t>()[b]; }
  int64_t start_k(int64_t b) const { return cu_k.data_ptr<int32_t>()[b]; }
  int64_t len_q(int64_t b) const { return start_q(b + 1) - start_q(b); }
  int64_t len_k(int64_t b) const { return start_k(b + 1) - start_k(b); }
};

// Checks q [total_q, Hq, d], k and v [total_k, Hkv, d] (one dtype and device,
// Hq a multiple of Hkv), cu_seqlens_q and cu_seqlens_k (int32 [B + 1] on q's
// device, 0 first, non-decreasing, the total last) and max_seqlen_* (at
// least every sequence's length); reads the lengths to the host.
VarlenLengths check_varlen_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k);

// cu_seqlens (int32 [B + 1] on `packed`'s device, 0 first, non-decreasing,
// ending at packed's rows, no sequence longer than max_seqlen) on the host.
at::Tensor check_cu_seqlens(const char* op, const at::Tensor& cu, const char* name, const at::Tensor& packed,
                            const char* packed_name, int64_t max_seqlen, const char* max_name);

// backward_varlen's grad_out and out ([total_q, Hq, d_v], from q and v) and
// lse (float32 [Hq, total_q]).
void check_varlen_outputs(const char* op, const at::Tensor& q, const at::Tensor& v, const at::Tensor& grad_out,
                          const at::Tensor& out, const at::Tensor& lse);

// Rows [start, start + n) of a packed [total, H, d] tensor as [1, H, n, d]
// (a view: strides H x d, d, 1 and the last dimension contiguous).
at::Tensor sequence_view(const at::Tensor& packed, int64_t start, int64_t n);
// The whole packed tensor as the [1, H, total, d] view the kernels take.
at::Tensor as_one_batch(const at::Tensor& packed);
// That view back: [1, H, total, d] -> [total, H, head_dim], cut to the call's head dim.
at::Tensor as_packed(const at::Tensor& batch, int64_t head_dim);

struct PreparedBackward;
// b's gradients allocated packed ([total, H, d], the shape of the call's q,
// k and v) and contiguous whatever the operands' layouts (head-major,
// expanded heads), as the fake function says; b's kernels write them through
// as_one_batch's views.
void use_packed_gradients(PreparedBackward& b);

// One sequence's dense forward: q, k, v [1, H, n, d] views; writes out (a
// [1, Hq, n, d_v] view) and lse (contiguous float32 [1, Hq, n]).
using SequenceForward = std::function<void(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& lse)>;
// One sequence's dense backward from [1, H, n, x] views and lse [1, Hq, n]:
// (grad_q, grad_k, grad_v).
using SequenceBackward = std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse)>;

// A packed call as one dense call per sequence with queries (the gemm
// family's, on either device): (out [total_q, Hq, d_v], lse [Hq, total_q]).
std::tuple<at::Tensor, at::Tensor> forward_by_sequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const VarlenLengths& seq, const SequenceForward& forward);
// The same for the backward: (grad_q, grad_k, grad_v), zero for a sequence
// with no queries or no keys (its outputs are constant in the other side).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_by_sequence(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const VarlenLengths& seq, const SequenceBackward& backward);

}  // namespace fusedattn::ops
