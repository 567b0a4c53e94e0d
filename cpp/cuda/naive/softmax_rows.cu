// One thread block per row of S: each thread keeps a running max and sum of
// exp over its strided share of the row (the online-softmax recurrence), the
// block merges them, and a second sweep writes P = exp(x - m) / l.
#include <cmath>

#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "softmax_rows.h"

namespace fusedattn::cuda {
namespace {

constexpr int kThreads = 256;

// Running (max, sum of exp(x - max)) of a set of scores.
struct RowStats {
  float m = -INFINITY;
  float l = 0.0f;
};

__device__ __forceinline__ RowStats merge(RowStats a, RowStats b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.l * __expf(a.m - m) + b.l * __expf(b.m - m)};
}

__device__ RowStats block_merge(RowStats s) {
  __shared__ RowStats warp_stats[kThreads / 32];
  __shared__ RowStats row;
  for (int offset = 16; offset > 0; offset /= 2)
    s = merge(s, {__shfl_xor_sync(0xffffffff, s.m, offset), __shfl_xor_sync(0xffffffff, s.l, offset)});
  if (threadIdx.x % 32 == 0) warp_stats[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowStats total;
    for (int w = 0; w < kThreads / 32; ++w) total = merge(total, warp_stats[w]);
    row = total;
  }
  __syncthreads();
  return row;
}

// A scaled score x with attn_mask's entry at `at` applied: a bool mask hides
// (x stays x where it may attend, even +inf); an additive one adds, in natural units.
template <MaskKind Kind, typename T>
__device__ __forceinline__ float masked_score(float x, const MaskParams& m, int64_t at) {
  if constexpr (Kind == MaskKind::None)
    return x;
  else if constexpr (Kind == MaskKind::Bool)
    return mask_entry<Kind, T>(m.ptr, at) == 0.0f ? x : -INFINITY;
  else
    return x + mask_entry<Kind, T, /*Log2=*/false>(m.ptr, at);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) softmax_rows_kernel(const SoftmaxRowsParams p) {
  const int64_t row_index = blockIdx.x;  // over B * Hq * Nq
  const int64_t i = row_index % p.seqlen_q;
  const int64_t bh = row_index / p.seqlen_q;
  const int64_t batch = bh / p.heads, head = bh % p.heads;
  T* row = static_cast<T*>(p.scores) + row_index * p.seqlen_k;
  const int64_t mask_row = batch * p.mask.batch_stride + head * p.mask.head_stride +
                           i * p.mask.row_stride;
  const Band band = Band::causal(p.is_causal, p.seqlen_q, p.seqlen_k);

  auto softmax = [&](auto kind) {
    auto score = [&](int64_t j) -> float {
      if (!band.sees(i, j)) return -INFINITY;
      return masked_score<decltype(kind)::value, T>(to_float(row[j]) * p.scale, p.mask,
                                                    mask_row + j * p.mask.col_stride);
    };
    RowStats s;
    for (int64_t j = threadIdx.x; j < p.seqlen_k; j += kThreads) s = merge(s, {score(j), 1.0f});
    const RowStats total = block_merge(s);
    const float inv_l = total.l > 0.0f ? 1.0f / total.l : 0.0f;
    for (int64_t j = threadIdx.x; j < p.seqlen_k; j += kThreads) {
      const float x = score(j);
      row[j] = from_float<T>(x == -INFINITY ? 0.0f : __expf(x - total.m) * inv_l);
    }
  };
  if (p.mask.kind == MaskKind::None)
    softmax(std::integral_constant<MaskKind, MaskKind::None>{});
  else
    dispatch_mask_kind(p.mask.kind, softmax);
}

}  // namespace

void softmax_rows(const SoftmaxRowsParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads * p.seqlen_q;
  if (rows == 0 || p.seqlen_k == 0) return;
  if (rows > 2147483647) throw std::runtime_error("fusedattn: too many rows for softmax_rows");
  const dim3 grid(static_cast<unsigned>(rows));
  if (p.dtype == DType::Float16)
    softmax_rows_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  else if (p.dtype == DType::BFloat16)
    softmax_rows_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  else
    throw std::invalid_argument("fusedattn: softmax_rows takes float16 or bfloat16");
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
