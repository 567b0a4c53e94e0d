// What the backward's kernel families share: the kernels around the
// key-block kernel (delta and the zeroed dQ accumulator before it; the
// conversions of the float32 sums after it), the store of a warp's dK and dV,
// and the order in which they run (the walk of a key block:
// key_block_scheduler.cuh).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "device_math.cuh"
#include "launch_check.h"
#include "fusedattn/params.h"
#include "fusedattn/plan.h"

namespace fusedattn::cuda {

// The passes around the key-block kernel move 8 elements per thread with
// 16-byte loads and stores: out and grad_out rows start on 16 bytes on CUDA
// (as_kernel_operand), and grad_q, grad_k, grad_v and the float32 sums are
// fresh, contiguous tensors. Head dims are multiples of 8: the operator
// layer lets only the instantiated ones reach a kernel (docs/architecture.md).
template <typename T>
struct Octet {  // 8 elements of T in one 16-byte word
  uint4 bits;
  __device__ float operator[](int j) const { return to_float(reinterpret_cast<const T*>(&bits)[j]); }
};

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&x)[8]) {
  return make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
}

// 8 floats from the 16-byte-aligned x, times scale.
__device__ __forceinline__ void load8_scaled(const float* x, float scale, float (&out)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(x)[0], hi = reinterpret_cast<const float4*>(x)[1];
  out[0] = lo.x * scale, out[1] = lo.y * scale, out[2] = lo.z * scale, out[3] = lo.w * scale;
  out[4] = hi.x * scale, out[5] = hi.y * scale, out[6] = hi.z * scale, out[7] = hi.w * scale;
}

// The threads of one warp that take a row in backward_preprocess_kernel:
// d / 8 rounded up to a power of two (the host checks d / 8 <= 32).
__host__ __device__ inline int preprocess_lanes(int64_t head_dim) {
  int lanes = 1;
  while (lanes * 8 < head_dim) lanes *= 2;
  return lanes;
}

// Why the passes around a key-block kernel cannot take a call (empty when
// they can): their grids are one launch each, and a row of the preprocess
// lies in one warp. The planner asks; run_backward_passes trusts its answer.
inline std::string backward_passes_refusal(const AttentionShape& sh) {
  if (sh.head_dim < 8 || sh.head_dim > 256 || sh.head_dim % 8 != 0)
    return "the CUDA backward's passes take head dims 8 to 256 in steps of 8, got " + std::to_string(sh.head_dim);
  const int64_t rows = sh.batch * sh.heads_q * sh.seqlen_q;
  const int64_t kv_size = sh.batch * sh.heads_kv * sh.seqlen_k * sh.head_dim;
  const int64_t rows_per_block = 128 / preprocess_lanes(sh.head_dim);
  if ((rows + rows_per_block - 1) / rows_per_block > 2147483647 || (rows * sh.head_dim / 8 + 255) / 256 > 2147483647 ||
      (kv_size / 8 + 255) / 256 > 2147483647)
    return "B x H x N x d of a CUDA backward must fit one launch of its passes (2^31 - 1 blocks of 256 x 8 "
           "elements)";
  return {};
}

// delta[row] = sum_d dO[row, d] O[row, d]; grad_q_accum[row, :] = 0 (when
// there is one). A row takes preprocess_lanes(d) threads of one warp, 8
// columns each (those past d idle), so a block of 128 takes 128 / lanes rows.
template <typename T>
__global__ void __launch_bounds__(128) backward_preprocess_kernel(const __grid_constant__ BackwardParams p) {
  const AttentionShape& sh = p.fwd.shape;
  const int lanes = preprocess_lanes(sh.head_dim);
  const int64_t row = int64_t(blockIdx.x) * (128 / lanes) + threadIdx.x / lanes;
  const int col = threadIdx.x % lanes * 8;
  const bool valid = row < sh.batch * sh.heads_q * sh.seqlen_q && col < sh.head_dim;
  float sum = 0.0f;
  if (valid) {
    const int64_t batch = row / (sh.heads_q * sh.seqlen_q), head = row / sh.seqlen_q % sh.heads_q,
                  query = row % sh.seqlen_q;
    const Octet<T> o{*reinterpret_cast<const uint4*>(static_cast<const T*>(p.fwd.out) +
                                                       batch * p.fwd.out_strides.batch +
                                                       head * p.fwd.out_strides.head +
                                                       query * p.fwd.out_strides.row + col)};
    const Octet<T> d_o{*reinterpret_cast<const uint4*>(static_cast<const T*>(p.grad_out) +
                                                         batch * p.grad_out_strides.batch +
                                                         head * p.grad_out_strides.head +
                                                         query * p.grad_out_strides.row + col)};
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += o[j] * d_o[j];
  }
  // The row's lanes are an aligned group of the warp; every lane takes part.
  for (int offset = lanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (!valid) return;
  if (col == 0) p.delta[row] = sum;
  if (p.grad_q_accum == nullptr) return;
  float4* accum = reinterpret_cast<float4*>(p.grad_q_accum + row * sh.head_dim + col);
  accum[0] = accum[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// grad_q = scale * grad_q_accum, in T, a zero as +0: the reduces add +0 into
// rows past a sequence's end (the next head's or sequence's), which only an
// accumulator at -0 (a subnormal sum flushed) could tell, and out of the
// deterministic mode's order. One thread per 8 elements.
template <typename T>
__global__ void __launch_bounds__(256) backward_convert_dq_kernel(const __grid_constant__ BackwardParams p) {
  const AttentionShape& sh = p.fwd.shape;
  const int64_t first = (int64_t(blockIdx.x) * 256 + threadIdx.x) * 8;
  if (first >= sh.batch * sh.heads_q * sh.seqlen_q * sh.head_dim) return;
  const int64_t row = first / sh.head_dim, col = first % sh.head_dim;
  const int64_t batch = row / (sh.heads_q * sh.seqlen_q), head = row / sh.seqlen_q % sh.heads_q,
                query = row % sh.seqlen_q;
  float dq[8];
  load8_scaled(p.grad_q_accum + first, p.fwd.scale, dq);
  // Tested on the bits: fast math may fold a float test of zero away.
#pragma unroll
  for (int j = 0; j < 8; ++j) dq[j] = __float_as_uint(dq[j]) << 1 == 0 ? 0.0f : dq[j];
  *reinterpret_cast<uint4*>(static_cast<T*>(p.grad_q) + batch * p.grad_q_strides.batch +
                            head * p.grad_q_strides.head + query * p.grad_q_strides.row + col) = pack8<T>(dq);
}

// grad_k, grad_v = the float32 sums of the head splits, in T. One thread per 8 elements.
template <typename T>
__global__ void __launch_bounds__(256) backward_convert_dkv_kernel(const __grid_constant__ BackwardParams p) {
  const AttentionShape& sh = p.fwd.shape;
  const int64_t size = sh.batch * sh.heads_kv * sh.seqlen_k * sh.head_dim;
  const int64_t first = (int64_t(blockIdx.x) * 256 + threadIdx.x) * 8;
  if (first >= size) return;
  const int64_t row = first / sh.head_dim, col = first % sh.head_dim;
  const int64_t batch = row / (sh.heads_kv * sh.seqlen_k), head = row / sh.seqlen_k % sh.heads_kv,
                key = row % sh.seqlen_k;
  float dk[8], dv[8];
  load8_scaled(p.grad_kv_accum + first, 1.0f, dk);
  load8_scaled(p.grad_kv_accum + size + first, 1.0f, dv);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.grad_k) + batch * p.grad_k_strides.batch +
                            head * p.grad_k_strides.head + key * p.grad_k_strides.row + col) = pack8<T>(dk);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.grad_v) + batch * p.grad_v_strides.batch +
                            head * p.grad_v_strides.head + key * p.grad_v_strides.row + col) = pack8<T>(dv);
}

// Where a block's dK and dV go: grad_k and grad_v from the sequence's first
// key (row k0 of kv head head_kv), or with head splits the float32 sums
// (dV's kv_size floats after dK's).
template <int HeadDim, typename T>
struct KeyGradientRows {
  T *grad_k, *grad_v;
  float* dk_sum;  // row 0's; null without head splits
  int64_t kv_size;
  __device__ __forceinline__ KeyGradientRows(const BackwardParams& p, int64_t batch, unsigned head_kv, int64_t k0) {
    const AttentionShape& sh = p.fwd.shape;
    kv_size = sh.batch * sh.heads_kv * sh.seqlen_k * HeadDim;
    dk_sum = p.head_splits > 1 ? p.grad_kv_accum + ((batch * sh.heads_kv + head_kv) * sh.seqlen_k + k0) * HeadDim
                               : nullptr;
    grad_k = static_cast<T*>(p.grad_k) + batch * p.grad_k_strides.batch + head_kv * p.grad_k_strides.head +
             k0 * p.grad_k_strides.row;
    grad_v = static_cast<T*>(p.grad_v) + batch * p.grad_v_strides.batch + head_kv * p.grad_v_strides.head +
             k0 * p.grad_v_strides.row;
  }
};

// dK (scaled: S was scale Q K^T) and dV of one warp's 16 keys, rows
// first_key + g and first_key + g + 8 of m16n8 accumulators (mma.sync's C
// layout, which wgmma's accumulators share per warp) among the sequence's
// seqlen_k keys, which start at row k0 of the kv head: written, or added to
// the float32 sums when the group's query heads are split over blocks.
template <int HeadDim, typename T>
__device__ __forceinline__ void store_key_gradients(const BackwardParams& p, int64_t batch, unsigned head_kv,
                                                    int64_t k0, int64_t first_key, int64_t seqlen_k,
                                                    const float (&dk)[HeadDim / 8][4],
                                                    const float (&dv)[HeadDim / 8][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float scale = p.fwd.scale;
  const KeyGradientRows<HeadDim, T> out(p, batch, head_kv, k0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t key = first_key + g + 8 * h;
    if (key >= seqlen_k) continue;
#pragma unroll
    for (int dt = 0; dt < HeadDim / 8; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (p.head_splits > 1) {
        float* dk_sum = out.dk_sum + key * HeadDim + col;
        red_add_float2(dk_sum, dk[dt][2 * h] * scale, dk[dt][2 * h + 1] * scale);
        red_add_float2(dk_sum + out.kv_size, dv[dt][2 * h], dv[dt][2 * h + 1]);
      } else {
        *reinterpret_cast<uint32_t*>(out.grad_k + key * p.grad_k_strides.row + col) =
            pack2<T>(dk[dt][2 * h] * scale, dk[dt][2 * h + 1] * scale);
        *reinterpret_cast<uint32_t*>(out.grad_v + key * p.grad_v_strides.row + col) =
            pack2<T>(dv[dt][2 * h], dv[dt][2 * h + 1]);
      }
    }
  }
}

// The whole backward around a family's key-block work, `launch_main()`: it
// must write grad_k and grad_v (or, with head splits, add to grad_kv_accum)
// and add dQ into grad_q_accum when there is one (else write grad_q: sm80's
// deterministic mode);
// it launches nothing for an empty side (no keys, or no queries).
template <typename T, typename LaunchMain>
void run_backward_passes(const BackwardParams& p, cudaStream_t stream, LaunchMain launch_main) {
  const AttentionShape& sh = p.fwd.shape;
  const int64_t rows = sh.batch * sh.heads_q * sh.seqlen_q;
  const int64_t kv_size = sh.batch * sh.heads_kv * sh.seqlen_k * sh.head_dim;
  if (const std::string why = backward_passes_refusal(sh); !why.empty()) throw_planner_bug(why);
  const int64_t rows_per_block = 128 / preprocess_lanes(sh.head_dim);
  if (rows > 0) {
    backward_preprocess_kernel<T>
        <<<static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block), 128, 0, stream>>>(p);
    FUSEDATTN_CUDA_CHECK(cudaGetLastError());
  }
  if (kv_size > 0 && p.head_splits > 1)
    FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(p.grad_kv_accum, 0, 2 * kv_size * sizeof(float), stream));
  if (kv_size > 0 || rows > 0) launch_main();
  if (kv_size > 0 && p.head_splits > 1) {
    backward_convert_dkv_kernel<T><<<static_cast<unsigned>((kv_size / 8 + 255) / 256), 256, 0, stream>>>(p);
    FUSEDATTN_CUDA_CHECK(cudaGetLastError());
  }
  if (rows > 0 && p.grad_q_accum != nullptr) {
    backward_convert_dq_kernel<T><<<static_cast<unsigned>((rows * sh.head_dim / 8 + 255) / 256), 256, 0, stream>>>(p);
    FUSEDATTN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace fusedattn::cuda
