// The sm90 forward, first rung: FlashAttention 2's loop with both GEMMs on
// Hopper's warpgroup MMA. One warpgroup (4 warps) per block of 64 queries;
// K/V tiles of 64 keys stream through shared memory with cp.async, K and V
// loads alternating as in the sm80 kernel, into 128-byte-swizzled tiles that
// wgmma reads through descriptors:
//   S = Q K^T          wgmma m64n64k16, both operands from shared memory
//   P = 2^(S - m')     online softmax in registers (the accumulator of each
//                      warp is laid out as mma.sync's, so the sm80 helpers apply)
//   O += P V           wgmma m64n{d}k16, P from registers, V read transposed
// Not yet: TMA, warp specialisation, overlap of softmax with the GEMMs,
// attn_mask (the dispatcher sends masked calls to the sm80 kernel).
#pragma once

#include <cmath>

#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/online_softmax.cuh"
#include "forward_sm90.h"
#include "wgmma.cuh"

namespace fusedattn::cuda {

template <int HeadDim>
struct Sm90ForwardTraits {
  static constexpr int kThreads = 128;  // one warpgroup
  static constexpr int kBlockM = 64;    // one wgmma M
  static constexpr int kBlockN = 64;
  static constexpr int kChunksPerRow = HeadDim / 8;
  static constexpr int kTileBytes = 64 * HeadDim * 2;  // Q, K and V tiles alike
  // Q, K, V tiles, each 1024-byte aligned (the swizzle pattern's period),
  // plus room to align the dynamic shared memory base.
  static constexpr int kSmemBytes = 3 * kTileBytes + 1024;
  static_assert(HeadDim == 64 || HeadDim == 128, "wgmma tiles of 64-column slabs");
};

// Copies rows [row0, row0 + 64) of a [N, d] head into a swizzled tile;
// rows at or past valid_rows are zero-filled.
template <int HeadDim, typename T>
__device__ __forceinline__ void load_swizzled_async(unsigned char* tile, const T* head, int64_t row_stride,
                                                    int64_t row0, int64_t valid_rows) {
  using Tr = Sm90ForwardTraits<HeadDim>;
  for (int i = threadIdx.x; i < 64 * Tr::kChunksPerRow; i += Tr::kThreads) {
    const int r = i / Tr::kChunksPerRow, chunk = i % Tr::kChunksPerRow;
    const bool valid = r < valid_rows;
    cp_async_16(tile + swizzled_chunk_offset(r, chunk, 64),
                valid ? head + (row0 + r) * row_stride + chunk * 8 : head, valid);
  }
}

template <int HeadDim, typename T, bool IsCausal>
__global__ void __launch_bounds__(Sm90ForwardTraits<HeadDim>::kThreads)
    sm90_forward_kernel(const __grid_constant__ ForwardParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in sm_90a code
  using Tr = Sm90ForwardTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  constexpr int kNTiles = kBlockN / 8, kDTiles = HeadDim / 8;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + Tr::kTileBytes;
  unsigned char* sV = sK + Tr::kTileBytes;

  const AttentionShape& sh = p.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const unsigned m_blocks = static_cast<unsigned>((sh.seqlen_q + kBlockM - 1) / kBlockM);
  const unsigned bh = blockIdx.x / m_blocks, heads_q = static_cast<unsigned>(sh.heads_q);
  const unsigned batch = bh / heads_q, head = bh % heads_q;
  const unsigned head_kv = head / static_cast<unsigned>(sh.heads_q / sh.heads_kv);
  const unsigned m_index = blockIdx.x % m_blocks;
  const int64_t row0 = int64_t(IsCausal ? m_blocks - 1 - m_index : m_index) * kBlockM;
  const int64_t rows = min(int64_t(kBlockM), sh.seqlen_q - row0);
  const int64_t causal_offset = sh.seqlen_k - sh.seqlen_q;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_strides.batch + head * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_strides.batch + head_kv * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_strides.batch + head_kv * p.v_strides.head;

  int64_t key_end = sh.seqlen_k;
  if (IsCausal) key_end = max(int64_t(0), min(sh.seqlen_k, row0 + rows + causal_offset));
  const int n_tiles = static_cast<int>((key_end + kBlockN - 1) / kBlockN);

  load_swizzled_async<HeadDim>(sQ, q, p.q_strides.row, row0, rows);
  if (n_tiles > 0) load_swizzled_async<HeadDim>(sK, k, p.k_strides.row, 0, key_end);
  cp_async_commit();

  float acc[kDTiles][4] = {};
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {};
  const float scale_log2 = p.scale * kLog2e;
  const int warp_row = warp * 16;

  for (int j = 0; j < n_tiles; ++j) {
    const int64_t col0 = int64_t(j) * kBlockN;
    cp_async_wait<0>();  // K_j (and Q) landed
    // cp.async writes are generic-proxy stores; wgmma reads shared memory
    // through the async proxy: each writer fences, then the block syncs.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // ... for every thread; and the warpgroup is done with V_{j-1}
    load_swizzled_async<HeadDim>(sV, v, p.v_strides.row, col0, key_end - col0);
    cp_async_commit();

    // S = Q K^T
    float s[kNTiles][4];
    float (&s_flat)[kNTiles * 4] = reinterpret_cast<float (&)[kNTiles * 4]>(s);
    fence_registers(s_flat);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk)
      wgmma_ss<T, kBlockN>(s_flat, k_major_descriptor(sQ, 64, kk), k_major_descriptor(sK, 64, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s_flat);

    const bool needs_masking = col0 + kBlockN > key_end || (IsCausal && col0 + kBlockN - 1 > row0 + causal_offset);
    const int cols = static_cast<int>(min(int64_t(kBlockN), key_end - col0));
    const int diagonal = static_cast<int>(
        max(int64_t(-kBlockM - kBlockN), min(int64_t(kBlockM + kBlockN), row0 + causal_offset - col0)));
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (needs_masking) {
          const int r = warp_row + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
          if (c >= cols || (IsCausal && c - r > diagonal)) x = -INFINITY;
        }
        s[nt][e] = x;
      }
    }
    online_softmax_step(s, m_i, l_i, acc);

    cp_async_wait<0>();  // V_j landed
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // ... for every thread; and the warpgroup is done with K_j
    if (j + 1 < n_tiles) load_swizzled_async<HeadDim>(sK, k, p.k_strides.row, col0 + kBlockN, key_end - col0 - kBlockN);
    cp_async_commit();

    // O += P V, P from the S accumulators (16 keys per k-step).
    float (&acc_flat)[kDTiles * 4] = reinterpret_cast<float (&)[kDTiles * 4]>(acc);
    uint32_t a[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      probabilities_as_a<T>(a[kk], s, kk);
      fence_registers(a[kk]);
    }
    fence_registers(acc_flat);  // the rescaled accumulators
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_rs<T, HeadDim>(acc_flat, a[kk], mn_major_descriptor(sV, 64, kk), true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc_flat);
  }
  cp_async_wait<0>();

  // Epilogue: normalise once; fully masked rows (l = 0): out = 0, lse = -inf.
  float* lse = p.lse + (int64_t(batch) * sh.heads_q + head) * sh.seqlen_q;
  T* out = static_cast<T*>(p.out) + batch * p.out_strides.batch + head * p.out_strides.head;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_i[h]);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int r = warp_row + g + h * 8;
    if (r >= rows) continue;
    if (t == 0) lse[row0 + r] = lse_from_log2(m_i[h], l);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<uint32_t*>(out + (row0 + r) * p.out_strides.row + dt * 8 + 2 * t) =
          pack2<T>(acc[dt][2 * h] * inv, acc[dt][2 * h + 1] * inv);
  }
#else
  __trap();  // built for another target: sm90_forward_available() keeps callers away
#endif
}

template <int HeadDim, typename T, bool IsCausal>
void launch_sm90_forward_kernel(const ForwardParams& p, cudaStream_t stream) {
  using Tr = Sm90ForwardTraits<HeadDim>;
  auto kernel = sm90_forward_kernel<HeadDim, T, IsCausal>;
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const int64_t blocks = (p.shape.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM * p.shape.batch * p.shape.heads_q;
  if (blocks > 2147483647)
    throw std::runtime_error("fusedattn: B x Hq x query blocks exceeds one launch (2^31 - 1)");
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename Element>
void launch_forward_sm90(const ForwardParams& p, cudaStream_t stream) {
  if (p.shape.batch * p.shape.heads_q == 0 || p.shape.seqlen_q == 0) return;
  if (p.is_causal)
    launch_sm90_forward_kernel<HeadDim, Element, true>(p, stream);
  else
    launch_sm90_forward_kernel<HeadDim, Element, false>(p, stream);
}

}  // namespace fusedattn::cuda
