// Plain parameter structs shared by the operator layer and every kernel.
//
// The operator layer (cpp/ops) validates tensors and fills these; kernels read
// only these. Nothing here depends on ATen, so CUDA kernels can include it and
// stay free of PyTorch.
#pragma once

#include <cstdint>

namespace fusedattn {

enum class DType : int { Float32, Float16, BFloat16 };

// How attn_mask enters the scores.
//   None:             no mask.
//   Bool:             one byte per element, nonzero = may attend.
//   AdditiveFloat32:  float32 added to the scaled scores.
//   AdditiveInput:    same dtype as q, added to the scaled scores.
enum class MaskKind : int { None, Bool, AdditiveFloat32, AdditiveInput };

// attn_mask broadcast to [B, Hq, Nq, Nk]. A broadcast dimension has stride 0;
// nothing is materialised.
struct MaskParams {
  MaskKind kind = MaskKind::None;
  const void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;  // along Nq
  int64_t col_stride = 0;  // along Nk
};

// Strides of one [B, H, N, d] tensor whose last dimension is contiguous.
struct TensorStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
};

struct AttentionShape {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;

  int64_t group_size() const { return heads_q / heads_kv; }
  // Bottom-right causal alignment: query i may see key j iff j <= i + causal_offset.
  int64_t causal_offset() const { return seqlen_k - seqlen_q; }
};

struct ForwardParams {
  AttentionShape shape;
  DType dtype = DType::Float32;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // contiguous [B, Hq, Nq], natural log

  TensorStrides q_strides, k_strides, v_strides, out_strides;

  float scale = 1.0f;
  bool is_causal = false;
  MaskParams mask;
};

struct BackwardParams {
  ForwardParams fwd;  // q, k, v, out, lse (read only here), shape, mask, scale

  const void* grad_out = nullptr;
  void* grad_q = nullptr;
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  TensorStrides grad_out_strides, grad_q_strides, grad_k_strides, grad_v_strides;
};

}  // namespace fusedattn
