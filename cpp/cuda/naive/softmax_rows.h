// The naive path of seed 2: after a cuBLAS GEMM has written S = Q K^T, one
// fused kernel scales, masks and softmaxes every row of S in place; a second
// GEMM then computes P V. It materialises S on purpose: it is the baseline
// whose memory traffic the fused kernels avoid.
#pragma once

#include <cuda_runtime.h>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

struct SoftmaxRowsParams {
  void* scores = nullptr;  // contiguous [B, Hq, Nq, Nk], float16 or bfloat16, overwritten with P
  DType dtype = DType::Float16;
  int64_t batch = 0, heads = 0, seqlen_q = 0, seqlen_k = 0;
  float scale = 1.0f;
  bool is_causal = false;  // bottom-right aligned, as everywhere in fusedattn
  MaskParams mask;         // broadcast to [B, Hq, Nq, Nk]
};

// P = softmax(scale * S + mask) row by row; rows with nothing visible become 0.
void softmax_rows(const SoftmaxRowsParams& p, cudaStream_t stream);

}  // namespace fusedattn::cuda
