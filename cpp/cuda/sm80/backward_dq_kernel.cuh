// The deterministic way to grad_q: a pass of its own, one thread block per
// (block of 64 queries, query head, sequence; packed: a work list's), that walks the key blocks the
// queries can see and sums dQ in registers in a fixed order:
//   S  = Q K^T;  P = 2^(S scale log2 e + mask - lse log2 e);  dP = dO V^T
//   dS = P (dP - delta);  dQ += dS K;   grad_q = scale dQ
// (soft-capped, a template argument: S becomes tanh(S scale / cap), the
// exponent's factor cap log2 e, and dS takes tanh's slope).
// It recomputes S and dP, which the key-block kernel has already computed once
// (four GEMMs here against the one atomic-free GEMM it replaces): the price of
// the same bits on every run. Rows are queries, as in the forward, so P and dS
// are A operands straight from the accumulators.
#pragma once

#include <cmath>

#include "../common/band.cuh"
#include "../common/block_order.h"
#include "../common/device_math.cuh"
#include "../common/mask.cuh"
#include "../common/online_softmax.cuh"
#include "../common/sequences.cuh"
#include "../common/tile_loads.cuh"
#include "../tile_size.h"
#include "fusedattn/params.h"

namespace fusedattn::cuda {

template <int HeadDim>
struct DqTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;  // queries per block, 16 per warp
  static_assert(kBlockM == kSm80DqBlockM, "tile_size.h reports this tile");
  static constexpr int kBlockN = HeadDim <= 64 ? 64 : 32;  // keys per step (registers, as in the key-block kernel)
  static constexpr int kStride = HeadDim + 8;
  static constexpr int kChunksPerRow = HeadDim / 8;
  // Q, dO; K, V double-buffered.
  static constexpr int kSmemElements = 2 * kBlockM * kStride + 4 * kBlockN * kStride;
};

template <int HeadDim, typename T, bool Banded, bool Capped>
__global__ void __launch_bounds__(DqTraits<HeadDim>::kThreads)
    backward_dq_kernel(const __grid_constant__ BackwardParams p, const BlockOrder order) {
  using Tr = DqTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
  constexpr int kNTiles = kBlockN / 8, kDTiles = HeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kStride;
  T* sK = sdO + kBlockM * kStride;  // [2][kBlockN][kStride]
  T* sV = sK + 2 * kBlockN * kStride;

  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Dense: common/block_order.h's order; packed: the query tiles' work list.
  const unsigned heads_q = static_cast<unsigned>(sh.heads_q);
  const GridBlock block =
      f.varlen.on() ? work_item(f.varlen.query_tiles, blockIdx.x, heads_q) : order.at<Banded>(blockIdx.x);
  const unsigned head = block.pair % heads_q;
  const unsigned head_kv = head / static_cast<unsigned>(sh.heads_q / sh.heads_kv);
  const SequenceRows seq = SequenceRows::of(f, block.pair / heads_q, f.varlen.on());  // common/sequences.cuh
  const int64_t batch = seq.batch;
  const int64_t row0 = int64_t(block.block) * kBlockM;
  const int64_t rows = min(int64_t(kBlockM), seq.seqlen_q - row0);
  // Banded: the keys [key_begin, key_end) of common/band.cuh, from the tile holding key_begin.
  const Band band = Band::of(f, seq.seqlen_q, seq.seqlen_k);
  const int64_t key_begin = Banded ? band.key_begin(row0) : 0;
  const int64_t key_end = Banded ? band.key_end(row0 + rows - 1) : seq.seqlen_k;
  const int64_t tile0 = key_begin / kBlockN;
  const int64_t n_steps = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN - tile0 : 0;

  const T* k = static_cast<const T*>(f.k) + batch * f.k_strides.batch + head_kv * f.k_strides.head +
               seq.k0 * f.k_strides.row;
  const T* v = static_cast<const T*>(f.v) + batch * f.v_strides.batch + head_kv * f.v_strides.head +
               seq.k0 * f.v_strides.row;
  load_rows_async<kBlockM, Tr>(sQ,
                               static_cast<const T*>(f.q) + batch * f.q_strides.batch + head * f.q_strides.head +
                                   seq.q0 * f.q_strides.row,
                               f.q_strides.row, row0, rows);
  load_rows_async<kBlockM, Tr>(sdO,
                               static_cast<const T*>(p.grad_out) + batch * p.grad_out_strides.batch +
                                   head * p.grad_out_strides.head + seq.q0 * p.grad_out_strides.row,
                               p.grad_out_strides.row, row0, rows);
  auto load_keys = [&](int64_t step) {
    const int buf = step % 2;
    const int64_t col0 = (tile0 + step) * kBlockN;
    load_rows_async<kBlockN, Tr>(sK + buf * kBlockN * kStride, k, f.k_strides.row, col0, key_end - col0);
    load_rows_async<kBlockN, Tr>(sV + buf * kBlockN * kStride, v, f.v_strides.row, col0, key_end - col0);
  };
  if (n_steps > 0) load_keys(0);
  cp_async_commit();

  // lse (base 2; +inf for rows past the queries and rows that saw no key, so
  // that P = 0) and delta of this thread's two rows.
  const int warp_row = warp * 16;
  const int64_t row_base = (batch * sh.heads_q + head) * sh.seqlen_q + seq.q0 + row0;
  float lse_log2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row + g + 8 * h;
    const float lse = r < rows ? f.lse[row_base + r] : -INFINITY;
    lse_log2[h] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    delta[h] = r < rows ? p.delta[row_base + r] : 0.0f;
  }

  float dq[kDTiles][4] = {};
  const SoftCap cap = SoftCap::of(f);  // its scale_log2 takes a raw (or, Capped, capped) score to base-2 units
  const bool has_mask = f.mask.kind != MaskKind::None;
  const int64_t mask_base = batch * f.mask.batch_stride + head * f.mask.head_stride;

  for (int64_t step = 0; step < n_steps; ++step) {
    cp_async_wait<0>();
    __syncthreads();  // this step's K, V (and Q, dO) landed everywhere; the other buffer is free
    if (step + 1 < n_steps) load_keys(step + 1);
    cp_async_commit();
    const T* k_tile = sK + step % 2 * kBlockN * kStride;
    const T* v_tile = sV + step % 2 * kBlockN * kStride;
    const int64_t col0 = (tile0 + step) * kBlockN;

    // S = Q K^T and dP = dO V^T for this warp's 16 queries.
    float s[kNTiles][4] = {}, dp[kNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk) {
      uint32_t a_q[4], a_do[4];
      ldmatrix_x4(a_q, sQ + (warp_row + lane % 16) * kStride + kk * 16 + lane / 16 * 8);
      ldmatrix_x4(a_do, sdO + (warp_row + lane % 16) * kStride + kk * 16 + lane / 16 * 8);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        const int key_row = np * 16 + (lane & 7) + (lane >> 4 << 3), col = kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + key_row * kStride + col);
        mma_16x8x16<T>(s[2 * np], a_q, b[0], b[1]);
        mma_16x8x16<T>(s[2 * np + 1], a_q, b[2], b[3]);
        ldmatrix_x4(b, v_tile + key_row * kStride + col);
        mma_16x8x16<T>(dp[2 * np], a_do, b[0], b[1]);
        mma_16x8x16<T>(dp[2 * np + 1], a_do, b[2], b[3]);
      }
    }

    // dS = P (dP - delta), in place of S (capped: of tanh(S scale / cap), times tanh's slope).
    if constexpr (Capped) cap.apply(s);
    const bool needs_masking =
        has_mask || col0 + kBlockN > key_end || (Banded && band.cuts(row0, kBlockM, col0, kBlockN));
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int64_t query = row0 + warp_row + g + 8 * h, key = col0 + nt * 8 + 2 * t + (e & 1);
        const float slope = Capped ? SoftCap::slope(s[nt][e]) : 1.0f;
        float x = s[nt][e] * cap.scale_log2;  // the forward's score, mask included, then minus lse
        if (needs_masking) {
          if (key >= key_end || (Banded && !band.sees(query, key))) {
            x = -INFINITY;
          } else if (has_mask && query < seq.seqlen_q) {
            x += mask_log2<T>(f.mask, mask_base, query, key);
          }
        }
        s[nt][e] = exp2f(x - lse_log2[h]) * (dp[nt][e] - delta[h]) * slope;
      }
    }

    // dQ += dS K
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      probabilities_as_a<T>(a, s, kk);
      mma_a_times_rows<T, HeadDim, kStride>(dq, a, k_tile, kk * 16, lane);
    }
  }
  cp_async_wait<0>();

  T* grad_q = static_cast<T*>(p.grad_q) + batch * p.grad_q_strides.batch + head * p.grad_q_strides.head +
              seq.q0 * p.grad_q_strides.row;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row + g + 8 * h;
    if (r >= rows) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<uint32_t*>(grad_q + (row0 + r) * p.grad_q_strides.row + dt * 8 + 2 * t) =
          pack2<T>(dq[dt][2 * h] * f.scale, dq[dt][2 * h + 1] * f.scale);
  }
}

}  // namespace fusedattn::cuda
