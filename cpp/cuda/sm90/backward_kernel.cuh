// The sm90 backward's key-block kernel, first rung: FlashAttention 2's walk
// (the sm80 kernel's; common/backward_passes.cuh runs the kernels around it)
// with every product on Hopper's warpgroup MMA. One warpgroup per block of 64
// keys; per step of 64 queries of one query head, with Q, dO, lse and delta
// streamed into swizzled double buffers by cp.async:
//   S^T  = K Q^T,  dP^T = V dO^T        wgmma m64n64k16, operands in shared memory
//   P^T  = 2^(S^T scale log2 e - lse log2 e),  dS^T = P^T (dP^T - delta)
//   dV  += P^T dO,  dK += dS^T Q        wgmma m64n{d}k16, P^T and dS^T from the
//                                       accumulators (as P in the forward), Q and
//                                       dO read transposed
//   dQ   = dS K                         dS^T stored transposed (stmatrix) as a
//                                       K-major tile; 64 columns of d at a time;
//                                       added to the float32 accumulator with
//                                       8-byte reductions.
// dK and dV stay in registers across the walk (GQA's sum costs nothing).
// Not yet: TMA, warp specialisation, overlap between the steps' products,
// attn_mask and the deterministic mode (the dispatcher sends those to sm80).
#pragma once

#include <cmath>

#include "../common/backward_passes.cuh"
#include "../common/bulk_copy.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/online_softmax.cuh"
#include "../sm80/backward_sm80.h"
#include "backward_sm90.h"
#include "swizzled_loads.cuh"
#include "wgmma.cuh"

namespace fusedattn::cuda {

template <int HeadDim>
struct Sm90BackwardTraits {
  static constexpr int kThreads = 128;  // one warpgroup
  static constexpr int kBlockN = 64;    // keys: the M of the products that make dK, dV
  static constexpr int kBlockM = 64;    // queries per step
  static constexpr int kTileBytes = 64 * HeadDim * 2;  // K, V, Q, dO tiles alike
  static constexpr int kDsBytes = kBlockM * kBlockN * 2;
  // K, V, Q x 2, dO x 2, dS, each 1024-byte aligned (the swizzle's period);
  // lse and delta x 2 (float); room to align the base.
  static constexpr int kFloatsOffset = 6 * kTileBytes + kDsBytes;
  static constexpr int kSmemBytes = kFloatsOffset + 4 * kBlockM * 4 + 1024;
  static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of 64-column slabs");
  static_assert(kBlockN == kBackwardBlockN, "backward_head_splits counts blocks of kBackwardBlockN keys");
};

template <int HeadDim, typename T, bool IsCausal>
__global__ void __launch_bounds__(Sm90BackwardTraits<HeadDim>::kThreads)
    sm90_backward_kernel(const __grid_constant__ BackwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and stmatrix exist only in sm_90a code
  using Tr = Sm90BackwardTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kMTiles = kBlockM / 8;  // n-tiles of S^T (queries)
  constexpr int kDTiles = HeadDim / 8;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sK = smem;
  unsigned char* sV = sK + Tr::kTileBytes;
  unsigned char* sQ = sV + Tr::kTileBytes;         // buffer b at b * kTileBytes
  unsigned char* sdO = sQ + 2 * Tr::kTileBytes;    // buffer b at b * kTileBytes
  unsigned char* sdS = sdO + 2 * Tr::kTileBytes;   // dS [query][key], K-major for dQ = dS K
  float* sLse = reinterpret_cast<float*>(smem + Tr::kFloatsOffset);  // [2][kBlockM], natural log
  float* sDelta = sLse + 2 * kBlockM;                                 // [2][kBlockM]

  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const KeyBlockWalk<kBlockN, kBlockM, IsCausal> walk(p);
  const int64_t causal_offset = sh.seqlen_k - sh.seqlen_q;  // query i sees key j iff j <= i + offset

  const T* k = static_cast<const T*>(f.k) + walk.batch * f.k_strides.batch + walk.head_kv * f.k_strides.head;
  const T* v = static_cast<const T*>(f.v) + walk.batch * f.v_strides.batch + walk.head_kv * f.v_strides.head;
  load_swizzled_async<64, HeadDim, Tr::kThreads>(sK, k, f.k_strides.row, walk.key0, walk.keys);
  load_swizzled_async<64, HeadDim, Tr::kThreads>(sV, v, f.v_strides.row, walk.key0, walk.keys);

  // Queues step s's Q, dO, lse and delta into buffer `buf` (zeros past the queries).
  auto load_step = [&](int64_t s, int buf) {
    const int64_t head = walk.head(s), m0 = walk.m0(s);
    const int64_t rows = sh.seqlen_q - m0;
    load_swizzled_async<64, HeadDim, Tr::kThreads>(
        sQ + buf * Tr::kTileBytes,
        static_cast<const T*>(f.q) + walk.batch * f.q_strides.batch + head * f.q_strides.head, f.q_strides.row, m0,
        rows);
    load_swizzled_async<64, HeadDim, Tr::kThreads>(
        sdO + buf * Tr::kTileBytes,
        static_cast<const T*>(p.grad_out) + walk.batch * p.grad_out_strides.batch + head * p.grad_out_strides.head,
        p.grad_out_strides.row, m0, rows);
    load_lse_delta_async<kBlockM, Tr::kThreads>(sLse + buf * kBlockM, sDelta + buf * kBlockM, p,
                                                (int64_t(walk.batch) * sh.heads_q + head) * sh.seqlen_q + m0, rows);
  };
  if (walk.steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[kDTiles][4] = {}, dv[kDTiles][4] = {};
  float (&dk_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dk);
  float (&dv_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(dv);
  const float scale_log2 = f.scale * kLog2e;
  const int warp_row = warp * 16;  // this warp's accumulator rows: keys of S^T, queries of dQ

  for (int64_t s = 0; s < walk.steps; ++s) {
    const int buf = s % 2;
    cp_async_wait<0>();  // step s's Q, dO, lse, delta (and K, V) landed
    // cp.async writes are generic-proxy stores, wgmma reads through the async
    // proxy: each writer fences, then the block syncs. Every wgmma of step
    // s - 1 completed before its end, so its buffers are free.
    fence_proxy_async_shared();
    __syncthreads();
    if (s + 1 < walk.steps) load_step(s + 1, 1 - buf);
    cp_async_commit();

    const int64_t head = walk.head(s), m0 = walk.m0(s);
    const unsigned char* q_tile = sQ + buf * Tr::kTileBytes;
    const unsigned char* do_tile = sdO + buf * Tr::kTileBytes;
    const float* lse = sLse + buf * kBlockM;
    const float* delta = sDelta + buf * kBlockM;

    // S^T = K Q^T and dP^T = V dO^T: rows = this block's keys, columns = the step's queries.
    float st[kMTiles][4], dpt[kMTiles][4];
    float (&st_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(st);
    float (&dpt_flat)[kMTiles * 4] = reinterpret_cast<float (&)[kMTiles * 4]>(dpt);
    fence_registers(st_flat);
    fence_registers(dpt_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, 64>(st_flat, k_major_descriptor(sK, 64, kk), k_major_descriptor(q_tile, 64, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, 64>(dpt_flat, k_major_descriptor(sV, 64, kk), k_major_descriptor(do_tile, 64, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(st_flat);
    fence_registers(dpt_flat);

    // P^T and dS^T, element (key row g + 8h, query column 2t + e) of each n-tile.
    const bool needs_masking = walk.key0 + kBlockN > sh.seqlen_k || m0 + kBlockM > sh.seqlen_q ||
                               (IsCausal && walk.key0 + kBlockN - 1 > m0 + causal_offset);
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = warp_row + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
        float x = st[nt][e] * scale_log2;
        if (needs_masking) {
          const int64_t key = walk.key0 + r, query = m0 + c;
          if (key >= sh.seqlen_k || query >= sh.seqlen_q || (IsCausal && key > query + causal_offset))
            x = -INFINITY;
        }
        const float prob = exp2f(x - lse_in_log2(lse[c]));
        st[nt][e] = prob;
        dpt[nt][e] = prob * (dpt[nt][e] - delta[c]);
      }
    }
    uint32_t p_a[kBlockM / 16][4], ds_a[kBlockM / 16][4];
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      probabilities_as_a<T>(p_a[kq], st, kq);
      probabilities_as_a<T>(ds_a[kq], dpt, kq);
    }

    // dS = (dS^T)^T, [query][key] in a 128-byte-swizzled tile for dQ = dS K.
    // The A fragment of k-step kq holds the four 8x8 matrices (queries
    // (2 kq + i / 2) * 8.., this warp's keys (i % 2) * 8..) that a transposing
    // stmatrix writes as 16-byte rows of dS.
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      const int i = lane / 8, query = (2 * kq + i / 2) * 8 + lane % 8, key_chunk = 2 * warp + i % 2;
      stmatrix_x4_trans(ds_a[kq], sdS + swizzled_chunk_offset(query, key_chunk, 64));
    }
    fence_proxy_async_shared();  // dS: written through the generic proxy, read by wgmma

    // dV += P^T dO, dK += dS^T Q (scaled at the end); Q and dO are B operands
    // stored [query][d], read transposed.
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      fence_registers(p_a[kq]);
      fence_registers(ds_a[kq]);
    }
    fence_registers(dv_flat);
    fence_registers(dk_flat);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(dv_flat, p_a[kq], mn_major_descriptor(do_tile, 64, kq), true);
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      wgmma_rs<T, HeadDim>(dk_flat, ds_a[kq], mn_major_descriptor(q_tile, 64, kq), true);
    wgmma_commit();
    // Waiting here frees P^T's and dS^T's registers for dQ's (at d=128 the
    // overlap with dQ's products spilled).
    wgmma_wait<0>();
    fence_registers(dv_flat);
    fence_registers(dk_flat);
    __syncthreads();  // all of dS written (and fenced) by every warp

    // dQ = dS K, 64 columns of d at a time: rows = the step's queries (this
    // warp's 16), K read transposed from its swizzled slabs.
    float* accum = p.grad_q_accum + ((int64_t(walk.batch) * sh.heads_q + head) * sh.seqlen_q + m0) * HeadDim;
#pragma unroll
    for (int half = 0; half < HeadDim / 64; ++half) {
      float dq[8][4];
      float (&dq_flat)[32] = reinterpret_cast<float (&)[32]>(dq);
      fence_registers(dq_flat);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_ss<T, 64, true>(dq_flat, k_major_descriptor(sdS, 64, kk),
                              mn_major_descriptor(sK + half * 64 * 128, 64, kk), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(dq_flat);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + g + 8 * h;  // the query, within the step
        if (m0 + r >= sh.seqlen_q) continue;
#pragma unroll
        for (int dt = 0; dt < 8; ++dt)
          red_add_float2(accum + r * HeadDim + half * 64 + dt * 8 + 2 * t, dq[dt][2 * h], dq[dt][2 * h + 1]);
      }
    }
  }
  cp_async_wait<0>();
  fence_registers(dk_flat);
  fence_registers(dv_flat);
  store_key_gradients<HeadDim, T>(p, walk.batch, walk.head_kv, walk.key0 + warp_row, dk, dv);
#else
  __trap();  // built for another target: sm90_available() keeps callers away
#endif
}

template <int HeadDim, typename T, bool IsCausal>
void launch_sm90_backward_kernel(const BackwardParams& p, cudaStream_t stream) {
  using Tr = Sm90BackwardTraits<HeadDim>;
  auto kernel = sm90_backward_kernel<HeadDim, T, IsCausal>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const AttentionShape& sh = p.fwd.shape;
  const int64_t blocks = (sh.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN * p.head_splits * sh.heads_kv * sh.batch;
  if (blocks > 2147483647)
    throw std::runtime_error("fusedattn: B x Hkv x head splits x key blocks exceeds one launch (2^31 - 1)");
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename Element>
void launch_backward_sm90(const BackwardParams& p, cudaStream_t stream) {
  run_backward_passes<Element>(p, stream, [&] {
    if (p.fwd.shape.batch * p.fwd.shape.heads_kv * p.fwd.shape.seqlen_k == 0) return;
    if (p.fwd.is_causal)
      launch_sm90_backward_kernel<HeadDim, Element, true>(p, stream);
    else
      launch_sm90_backward_kernel<HeadDim, Element, false>(p, stream);
  });
}

}  // namespace fusedattn::cuda
