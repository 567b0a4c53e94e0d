// FlashAttention 2's forward on mma.sync tensor cores (sm_80 and newer).
//
// One thread block per (block of kBlockM queries, batch x query head; packed
// sequences: an item of the work list, common/sequences.cuh, x head); 4 warps,
// each owning kMTiles x 16 query rows. Q is loaded once; K/V tiles of kBlockN
// keys stream through shared memory with cp.async, K and V loads alternating
// so that one is always in flight while the other is computed on:
//   S   = (scale log2 e) Q K^T                      mma.sync, fp32 accumulators
//         (soft-capped: (cap log2 e) tanh(scale Q K^T / cap), common/online_softmax.cuh)
//   m'  = max(m, rowmax S);  P = 2^(S - m')
//   l   = 2^(m - m') l + rowsum P;  acc = 2^(m - m') acc + P V   (P from registers)
//   out = acc / l,  lse = (m + log2 l) ln 2
// Shared-memory rows are padded by 16 bytes, so the 8 row addresses of every
// ldmatrix fall in distinct banks. A banded call (causal, a window:
// common/band.cuh) visits only the key tiles its band reaches; under attn_mask
// the tiles of its list (common/mask_tiles.h: those the mask leaves visible,
// sorted before the launch). Only tiles on the band's edges, at the end of the
// keys, or that the list marks as reading the mask pay for element-wise masking.
#pragma once

#include <cmath>

#include "../common/band.cuh"
#include "../common/block_order.h"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "../common/mask_tiles.h"
#include "../common/online_softmax.cuh"
#include "../common/sequences.cuh"
#include "../common/tile_loads.cuh"
#include "../tile_size.h"
#include "forward_sm80.h"

namespace fusedattn::cuda {

template <int HeadDim>
struct ForwardTraits {
  static constexpr int kWarps = kSm80Warps;
  static constexpr int kThreads = 32 * kWarps;
  // 16-row MMA tiles per warp. Two would let every K/V fragment read from
  // shared memory feed two MMAs, but the registers they take cost occupancy,
  // which is what this kernel is bound by (docs/tuning.md).
  static constexpr int kMTiles = 1;
  // Blocks per SM the register allocation must allow (the launch bound; 0 =
  // none): 4 fits d <= 64 in 128 registers for sm_90; sm_80's code spills
  // there, so it gets 3 blocks and 168. d=128 unbounded takes 162-168
  // registers, which allows 3 blocks; a bound of 3 spills and a bound of 1
  // takes 196 (2 blocks).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr int kMinBlocksPerSM = HeadDim <= 64 ? 3 : 0;
#else
  static constexpr int kMinBlocksPerSM = HeadDim <= 64 ? 4 : 0;
#endif
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kBlockN = kSm80ForwardBlockN;
  static_assert(kBlockM == kSm80ForwardBlockM, "tile_size.h reports this tile");
  static constexpr int kStride = HeadDim + 8;  // elements per shared-memory row (16-byte pad)
  static constexpr int kChunksPerRow = HeadDim / 8;  // 16-byte chunks
  static constexpr int kSmemElements = (kBlockM + 2 * kBlockN) * kStride;  // Q, K, V
  static_assert(HeadDim % 16 == 0 && kBlockN % 16 == 0, "MMA tiles are 16 wide");
};

struct HeadOffsets {
  int64_t q, k, v, out;
};

template <int HeadDim, typename T, bool Banded, bool Listed>
__global__ void __launch_bounds__(ForwardTraits<HeadDim>::kThreads, ForwardTraits<HeadDim>::kMinBlocksPerSM)
    forward_kernel(const __grid_constant__ ForwardParams p, const BlockOrder order) {
  using Tr = ForwardTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
  constexpr int kMTiles = Tr::kMTiles, kNTiles = kBlockN / 8, kDTiles = HeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;  // [kBlockN][kStride]
  T* sV = sK + kBlockN * kStride;

  const AttentionShape& sh = p.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group and column pair
  // Dense: common/block_order.h's order; packed: the query tiles' work list.
  // (Packed calls have no attn_mask: the branch in Listed's code made it
  // spill at d=64 and take 212 registers at d=128, ptxas.)
  const bool packed = !Listed && p.varlen.on();
  const unsigned heads_q = static_cast<unsigned>(sh.heads_q);
  const GridBlock block =
      packed ? work_item(p.varlen.query_tiles, blockIdx.x, heads_q) : order.at<Banded>(blockIdx.x);
  const unsigned head = block.pair % heads_q;
  const unsigned head_kv = head / static_cast<unsigned>(sh.heads_q / sh.heads_kv);
  const SequenceRows seq = SequenceRows::of(p, block.pair / heads_q, packed);  // common/sequences.cuh
  const int64_t batch = seq.batch;
  const int64_t row0 = int64_t(block.block) * kBlockM;
  const int64_t rows = min(int64_t(kBlockM), seq.seqlen_q - row0);
  const Band band = Band::of(p, seq.seqlen_q, seq.seqlen_k);

  const T* q = static_cast<const T*>(p.q) + batch * p.q_strides.batch + head * p.q_strides.head +
               seq.q0 * p.q_strides.row;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_strides.batch + head_kv * p.k_strides.head +
               seq.k0 * p.k_strides.row;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_strides.batch + head_kv * p.v_strides.head +
               seq.k0 * p.v_strides.row;
  const int64_t mask_base = batch * p.mask.batch_stride + head * p.mask.head_stride;

  // Keys outside [key_begin, key_end) are hidden from every query of the
  // block; it visits the tiles from the one holding key_begin, or (attn_mask)
  // those of its list. entry(j): 2 x tile j's key tile, + 1 where it reads the mask.
  const int64_t key_begin = Banded ? band.key_begin(row0) : 0;
  const int64_t key_end = Banded ? band.key_end(row0 + rows - 1) : seq.seqlen_k;
  const int64_t tile0 = key_begin / kBlockN;
  int n_tiles = key_end > key_begin ? static_cast<int>((key_end + kBlockN - 1) / kBlockN - tile0) : 0;
  // (Listed, attn_mask's instantiation, a template argument: decided at run
  // time, the list spilled registers at d=64 on sm_90a.)
  const MaskTiles& tiles = p.mask.tiles;
  const int32_t* list = nullptr;
  if constexpr (Listed) {
    const int64_t row = tiles.row(batch, head, block.block);
    list = tiles.list(row);
    if (n_tiles > 0) n_tiles = tiles.counts[row];
  }
  auto entry = [&](int j) { return Listed ? list[j] : MaskTiles::entry(tile0 + j, false); };
  auto tile_col0 = [&](int j) { return int64_t(MaskTiles::tile_of(entry(j))) * kBlockN; };

  // The K and V loads alternate (FlashAttention 2's pipeline): V_j streams in
  // while S_j = Q K_j^T and its softmax are computed, K_{j+1} while P_j V_j is.
  // One buffer each keeps shared memory at (kBlockM + 2 kBlockN) rows, so more
  // blocks fit on an SM.
  load_rows_async<kBlockM, Tr>(sQ, q, p.q_strides.row, row0, rows);
  if (n_tiles > 0) load_rows_async<kBlockN, Tr>(sK, k, p.k_strides.row, tile_col0(0), key_end - tile_col0(0));
  cp_async_commit();

  float acc[kMTiles][kDTiles][4] = {};
  float m_i[kMTiles][2], l_i[kMTiles][2] = {};
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) m_i[mt][0] = m_i[mt][1] = -INFINITY;
  const SoftCap cap = SoftCap::of(p);
  const float scale_log2 = cap.scale_log2;
  const int warp_row = warp * 16 * kMTiles;  // first row of this warp in the block

  for (int j = 0; j < n_tiles; ++j) {
    const int32_t tile_entry = entry(j);
    const int64_t col0 = int64_t(MaskTiles::tile_of(tile_entry)) * kBlockN;
    const bool reads_mask = Listed && MaskTiles::reads_mask(tile_entry);
    cp_async_wait<0>();  // K_j (and Q) landed
    __syncthreads();     // ... for every thread; and every warp is done with V_{j-1}

    load_rows_async<kBlockN, Tr>(sV, v, p.v_strides.row, col0, key_end - col0);
    cp_async_commit();

    // S = Q K^T
    float s[kMTiles][kNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        ldmatrix_x4(a[mt], sQ + (warp_row + mt * 16 + lane % 16) * kStride + kk * 16 + lane / 16 * 8);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sK + (np * 16 + (lane & 7) + (lane >> 4 << 3)) * kStride + kk * 16 +
                           ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16x8x16<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16x8x16<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    const bool needs_masking =
        reads_mask || col0 + kBlockN > key_end || (Banded && band.cuts(row0, kBlockM, col0, kBlockN));
    // Tile-local bounds as 32-bit ints: column c is past the keys when
    // c >= cols, and outside the band when c - r < lo or c - r > hi.
    const int cols = static_cast<int>(min(int64_t(kBlockN), key_end - col0));
    int lo = 0, hi = 0;
    band.local(row0, col0, kBlockM + kBlockN, lo, hi);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      if (cap.on()) cap.apply(s[mt]);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][nt][e] * scale_log2;
          if (needs_masking) {
            const int r = warp_row + mt * 16 + g + (e >> 1) * 8;
            const int c = nt * 8 + 2 * t + (e & 1);
            if (c >= cols || (Banded && (c - r < lo || c - r > hi))) {
              x = -INFINITY;
            } else if (reads_mask && r < rows) {
              x += mask_log2<T>(p.mask, mask_base, row0 + r, col0 + c);
            }
          }
          s[mt][nt][e] = x;
        }
      }
      online_softmax_step(s[mt], m_i[mt], l_i[mt], acc[mt]);
    }

    cp_async_wait<0>();  // V_j landed
    __syncthreads();     // ... for every thread; and every warp is done with K_j
    if (j + 1 < n_tiles) load_rows_async<kBlockN, Tr>(sK, k, p.k_strides.row, tile_col0(j + 1), key_end - tile_col0(j + 1));
    cp_async_commit();

    // acc += P V, P straight from the S accumulators (the C layout of two
    // n-tiles is the A layout of one k-step).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) probabilities_as_a<T>(a[mt], s[mt], kk);
#pragma unroll
      for (int dp = 0; dp < HeadDim / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * kStride +
                                 dp * 16 + (lane >> 4 << 3));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16x8x16<T>(acc[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16x8x16<T>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: the head's sink (if any) joins the sum; normalise once, stage
  // the tile in shared memory (Q's space) and write it with 16-byte stores.
  // Rows that saw nothing (l = 0): out = 0, lse = -inf.
  float* lse = p.lse + (batch * sh.heads_q + head) * sh.seqlen_q + seq.q0;
  const float sink = sink_in_log2(p.sinks, head);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = quad_sum(l_i[mt][h]), m = m_i[mt][h];
      const float acc_scale = add_valueless_logit(sink, m, l);
      const float inv = l > 0.0f ? acc_scale / l : 0.0f;
      const int r = warp_row + mt * 16 + g + h * 8;
      if (t == 0 && r < rows)
        lse[row0 + r] = lse_from_log2(m, l);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<uint32_t*>(sQ + r * kStride + dt * 8 + 2 * t) =
            pack2<T>(acc[mt][dt][2 * h] * inv, acc[mt][dt][2 * h + 1] * inv);
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + batch * p.out_strides.batch + head * p.out_strides.head +
           seq.q0 * p.out_strides.row;
#pragma unroll
  for (int c = threadIdx.x; c < kBlockM * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = c % Tr::kChunksPerRow * 8;
    if (r < rows)
      *reinterpret_cast<uint4*>(out + (row0 + r) * p.out_strides.row + col) =
          *reinterpret_cast<const uint4*>(sQ + r * kStride + col);
  }
}

template <int HeadDim, typename T, bool Banded, bool Listed>
void launch_forward_kernel(const ForwardParams& p, cudaStream_t stream) {
  using Tr = ForwardTraits<HeadDim>;
  auto kernel = forward_kernel<HeadDim, T, Banded, Listed>;
  constexpr int smem_bytes = Tr::kSmemElements * sizeof(T);
  FUSEDATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const BlockOrder order = make_query_block_order(p.shape, Tr::kBlockM, sizeof(T), Banded);
  if constexpr (Listed) sort_mask_into_tiles(p, Tr::kBlockM, Tr::kBlockN, stream);
  const unsigned blocks = grid_blocks(order, p.varlen.on(), p.varlen.query_items, p.shape.heads_q);
  if (blocks == 0) return;
  kernel<<<blocks, Tr::kThreads, smem_bytes, stream>>>(p, order);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename Element>
void launch_forward_sm80(const ForwardParams& p, cudaStream_t stream) {
  if (p.shape.batch * p.shape.heads_q == 0 || p.shape.seqlen_q == 0) return;
  auto with_band = [&](auto listed) {
    if (p.banded())
      launch_forward_kernel<HeadDim, Element, true, decltype(listed)::value>(p, stream);
    else
      launch_forward_kernel<HeadDim, Element, false, decltype(listed)::value>(p, stream);
  };
  if (p.mask.kind != MaskKind::None)
    with_band(std::true_type{});
  else
    with_band(std::false_type{});
}

}  // namespace fusedattn::cuda
