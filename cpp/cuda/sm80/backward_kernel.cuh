// FlashAttention 2's backward on mma.sync tensor cores (sm_80 and newer).
//
// Three kernels:
//   1. preprocess: delta = rowsum(dO * O) per query row (float32), and the
//      float32 grad_q accumulator zeroed;
//   2. the main kernel, one thread block per (block of kBlockN keys, kv head,
//      sequence). It walks every query head of the kv head's group and every
//      block of kBlockM queries that can see its keys, recomputing from the
//      saved LSE instead of storing P:
//        S^T  = K Q^T                      P^T = 2^(S^T scale log2 e + mask - lse log2 e)
//        dV  += P^T dO                     dP^T = V dO^T
//        dS^T = P^T (dP^T - delta)         dK  += dS^T Q          (scaled at the end)
//      (soft-capped, a template argument: S^T becomes tanh(S^T scale / cap),
//      the exponent's factor cap log2 e, and dS^T takes tanh's slope);
//        dQ  += dS K, added to the float32 accumulator with atomics (or,
//               deterministic, left to backward_dq_kernel.cuh's own pass)
//      Each warp owns 16 keys (the rows of S^T, so P^T and dS^T are A
//      operands straight from the accumulators, as P is in the forward), and
//      keeps their dK and dV in registers across the whole walk: GQA's sum
//      over the group's query heads costs nothing extra. The next query
//      block's Q and dO stream in with cp.async while one is computed on;
//   3. convert: grad_q = scale * accumulator, in the input dtype.
// Kernels 1 and 3 are shared with the sm90 family (common/backward_passes.cuh).
#pragma once

#include <cmath>
#include <type_traits>

#include "../common/backward_passes.cuh"
#include "../common/key_block_scheduler.cuh"
#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/mask.cuh"
#include "../common/mask_tiles.h"
#include "../common/online_softmax.cuh"
#include "../common/sequences.cuh"
#include "../common/tile_loads.cuh"
#include "../tile_size.h"
#include "backward_dq_kernel.cuh"
#include "backward_sm80.h"

namespace fusedattn::cuda {

template <int HeadDim>
struct BackwardTraits {
  static constexpr int kWarps = kSm80Warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = kSm80BackwardBlockN;  // keys per block, 16 per warp
  static_assert(kBlockN == 16 * kWarps);
  static constexpr int kBlockM = sm80_backward_block_m(HeadDim);  // queries per step
  static constexpr int kStride = HeadDim + 8;  // elements per shared-memory row (16-byte pad)
  static constexpr int kChunksPerRow = HeadDim / 8;
  static constexpr int kDsStride = kBlockM + 8;  // dS^T rows [key][query], padded
  // dQ = dS K of a step: kBlockM / 16 row tiles x HeadDim / 8 column tiles
  // shared by the warps, row tiles first.
  static constexpr int kDqWarpsM = kBlockM / 16 < kWarps ? kBlockM / 16 : kWarps;
  static constexpr int kDqWarpsD = kWarps / kDqWarpsM;
  static constexpr int kDqTiles = HeadDim / 8 / kDqWarpsD;
  // K, V; Q and dO double-buffered; dS^T (elements), then lse and delta (floats).
  static constexpr int kSmemElements = 2 * kBlockN * kStride + 4 * kBlockM * kStride + kBlockN * kDsStride;
  static constexpr int kSmemFloats = 4 * kBlockM;
  static_assert(HeadDim % 16 == 0 && kBlockM % 16 == 0 && kDqWarpsM * kDqWarpsD == kWarps);
};

// Queues rows [row0, row0 + Rows) of lse and delta (one query head's, from
// `first` = its row 0) into shared memory with cp.async; rows at or past
// `rows` read as 0 (callers mask those queries). Every one of the Threads
// threads calls it.
template <int Rows, int Threads>
__device__ __forceinline__ void load_lse_delta_async(float* s_lse, float* s_delta, const BackwardParams& p,
                                                     int64_t first, int64_t rows) {
  for (int i = threadIdx.x; i < 2 * Rows; i += Threads) {
    const int r = i % Rows;
    const bool valid = r < rows;
    if (i < Rows)
      cp_async_4(s_lse + r, valid ? p.fwd.lse + first + r : p.fwd.lse, valid);
    else
      cp_async_4(s_delta + r, valid ? p.delta + first + r : p.delta, valid);
  }
}

template <int HeadDim, typename T, bool Banded, bool AtomicDq, bool Capped>
__global__ void __launch_bounds__(BackwardTraits<HeadDim>::kThreads)
    backward_kernel(const __grid_constant__ BackwardParams p, const BlockOrder order) {
  using Tr = BackwardTraits<HeadDim>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStride = Tr::kStride;
  constexpr int kMTiles = kBlockM / 8;  // n-tiles of S^T (queries)
  constexpr int kDTiles = HeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;        // [2][kBlockM][kStride]
  T* sdO = sQ + 2 * kBlockM * kStride;   // [2][kBlockM][kStride]
  T* sdS = sdO + 2 * kBlockM * kStride;  // [kBlockN][kDsStride], dS^T
  float* sLse = reinterpret_cast<float*>(sdS + kBlockN * Tr::kDsStride);  // [2][kBlockM], natural log
  float* sDelta = sLse + 2 * kBlockM;                                      // [2][kBlockM]

  const ForwardParams& f = p.fwd;
  const AttentionShape& sh = f.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Pairs are (sequence, kv head, head split); causal: key block 0, which
  // the most queries see, first (common/block_order.h). Packed: the key
  // tiles' work list (one split).
  const unsigned heads_kv = static_cast<unsigned>(sh.heads_kv);
  const GridBlock block =
      f.varlen.on() ? work_item(f.varlen.key_tiles, blockIdx.x, heads_kv) : order.at<false>(blockIdx.x);
  const unsigned n_block = block.block;
  const unsigned head_split = block.pair % static_cast<unsigned>(p.head_splits);
  const unsigned bh = block.pair / static_cast<unsigned>(p.head_splits);
  const unsigned head_kv = bh % heads_kv;
  const SequenceRows seq = SequenceRows::of(f, bh / heads_kv, f.varlen.on());  // common/sequences.cuh
  const int64_t batch = seq.batch;
  const int64_t group = sh.heads_q / sh.heads_kv;
  const int64_t split_heads = group / p.head_splits;  // query heads this block walks
  const int64_t first_head = head_kv * group + head_split * split_heads;
  const int64_t key0 = int64_t(n_block) * kBlockN;
  const int64_t keys = min(int64_t(kBlockN), seq.seqlen_k - key0);
  const Band band = Band::of(f, seq.seqlen_q, seq.seqlen_k);

  const T* k = static_cast<const T*>(f.k) + batch * f.k_strides.batch + head_kv * f.k_strides.head +
               seq.k0 * f.k_strides.row;
  const T* v = static_cast<const T*>(f.v) + batch * f.v_strides.batch + head_kv * f.v_strides.head +
               seq.k0 * f.v_strides.row;
  load_rows_async<kBlockN, Tr>(sK, k, f.k_strides.row, key0, keys);
  load_rows_async<kBlockN, Tr>(sV, v, f.v_strides.row, key0, keys);

  // The steps: every query block of every query head of the block's share of
  // the group that can see one of these keys: banded, queries
  // [first_query, query_end) (common/band.cuh); under attn_mask sorted into
  // tiles (common/mask_tiles.h), the query blocks of each head's list.
  const int64_t first_query = Banded ? band.query_begin(key0) : 0;
  const int64_t query_end = Banded ? band.query_end(key0 + keys - 1) : seq.seqlen_q;
  const int64_t m_begin = first_query / kBlockM * kBlockM;
  const MaskTiles& tiles = f.mask.tiles;
  const bool listed = tiles.lists != nullptr;
  auto list_row = [&](int64_t i) { return tiles.row(batch, first_head + i, n_block); };
  int64_t steps_per_head = first_query < query_end ? (query_end - m_begin + kBlockM - 1) / kBlockM : 0;
  int64_t steps = steps_per_head * split_heads;
  if (listed) {
    steps_per_head = tiles.counts[list_row(0)];  // the heads' lists are one where the mask is
    steps = steps_per_head * split_heads;
    if (tiles.head_stride != 0)
      for (int64_t i = 1; i < split_heads; ++i) steps += tiles.counts[list_row(i)] - steps_per_head;
  }
  const bool has_mask = f.mask.kind != MaskKind::None;
  // Step s: its query head, first query, and whether it reads attn_mask.
  auto locate = [&](int64_t s, int64_t& head, int64_t& m0, bool& reads) {
    if (!listed) {
      head = first_head + s / steps_per_head;
      m0 = m_begin + s % steps_per_head * kBlockM;
      reads = has_mask;
      return;
    }
    int64_t i = 0;
    if (tiles.head_stride == 0) {
      i = s / steps_per_head;
      s %= steps_per_head;
    } else {
      for (int64_t n; s >= (n = tiles.counts[list_row(i)]); ++i) s -= n;
    }
    const int32_t entry = tiles.list(list_row(i))[s];
    head = first_head + i;
    m0 = int64_t(MaskTiles::tile_of(entry)) * kBlockM;
    reads = MaskTiles::reads_mask(entry);
  };

  // Queues step s's Q, dO, lse and delta into buffer `buf` (cp.async; zeros
  // past the queries: their P V and dS Q terms are 0 as their dO and Q rows
  // are, and their dQ is not written).
  auto load_step = [&](int64_t s, int buf) {
    int64_t head, m0;
    bool reads;
    locate(s, head, m0, reads);
    const int64_t rows = seq.seqlen_q - m0;
    load_rows_async<kBlockM, Tr>(sQ + buf * kBlockM * kStride,
                                 static_cast<const T*>(f.q) + batch * f.q_strides.batch + head * f.q_strides.head +
                                     seq.q0 * f.q_strides.row,
                                 f.q_strides.row, m0, rows);
    load_rows_async<kBlockM, Tr>(sdO + buf * kBlockM * kStride,
                                 static_cast<const T*>(p.grad_out) + batch * p.grad_out_strides.batch +
                                     head * p.grad_out_strides.head + seq.q0 * p.grad_out_strides.row,
                                 p.grad_out_strides.row, m0, rows);
    load_lse_delta_async<kBlockM, Tr::kThreads>(sLse + buf * kBlockM, sDelta + buf * kBlockM, p,
                                                (batch * sh.heads_q + head) * sh.seqlen_q + seq.q0 + m0, rows);
  };
  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[kDTiles][4] = {}, dv[kDTiles][4] = {};
  const SoftCap cap = SoftCap::of(f);  // its scale_log2 takes a raw (or, Capped, capped) score to base-2 units
  const int key_row = warp * 16;  // this warp's first key in the block

  // The step's two products of each kind, on mma.sync fragments:
  // acc = this warp's 16 key rows of `keys` times the step's query rows of
  // `queries`, transposed (S^T = K Q^T, dP^T = V dO^T) ...
  auto keys_times_queries = [&](float (&acc)[kMTiles][4], const T* keys, const T* queries) {
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, keys + (key_row + lane % 16) * kStride + kk * 16 + lane / 16 * 8);
#pragma unroll
      for (int np = 0; np < kMTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, queries + (np * 16 + (lane & 7) + (lane >> 4 << 3)) * kStride + kk * 16 + ((lane >> 3) & 1) * 8);
        mma_16x8x16<T>(acc[2 * np], a, b[0], b[1]);
        mma_16x8x16<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  };
  // ... and acc += (the accumulators `by`, as A fragments) times the step's
  // rows of `queries` (dV += P^T dO, dK += dS^T Q).
  auto add_times_queries = [&](float (&acc)[kDTiles][4], const float (&by)[kMTiles][4], const T* queries) {
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      uint32_t a[4];
      probabilities_as_a<T>(a, by, kq);
      mma_a_times_rows<T, HeadDim, kStride>(acc, a, queries, kq * 16, lane);
    }
  };

  for (int64_t s = 0; s < steps; ++s) {
    const int buf = s % 2;
    cp_async_wait<0>();  // step s's Q, dO (and K, V) landed
    __syncthreads();     // ... for every thread, with its lse and delta; step s - 1 is done everywhere
    if (s + 1 < steps) load_step(s + 1, 1 - buf);
    cp_async_commit();

    int64_t head, m0;
    bool reads_mask;
    locate(s, head, m0, reads_mask);
    const T* q_tile = sQ + buf * kBlockM * kStride;
    const T* do_tile = sdO + buf * kBlockM * kStride;
    const float* lse = sLse + buf * kBlockM;
    const float* delta = sDelta + buf * kBlockM;

    // S^T = K Q^T for this warp's 16 keys and the step's queries.
    float st[kMTiles][4] = {};
    keys_times_queries(st, sK, q_tile);

    // P^T. Element (key row g + 8h, query column 2t + e) of each n-tile.
    [[maybe_unused]] float slope[Capped ? kMTiles : 1][4];  // tanh's, kept for dS^T
    if constexpr (Capped) {
      cap.apply(st);
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) slope[nt][e] = SoftCap::slope(st[nt][e]);
    }
    const bool needs_masking =
        reads_mask || key0 + kBlockN > seq.seqlen_k || (Banded && band.cuts(m0, kBlockM, key0, kBlockN));
    const int64_t mask_base = batch * f.mask.batch_stride + head * f.mask.head_stride;
#pragma unroll
    for (int nt = 0; nt < kMTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = key_row + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
        float x = st[nt][e] * cap.scale_log2;  // the forward's score, mask included, then minus lse
        if (needs_masking) {
          const int64_t key = key0 + r, query = m0 + c;
          if (key >= seq.seqlen_k || (Banded && !band.sees(query, key))) {
            x = -INFINITY;
          } else if (reads_mask && query < seq.seqlen_q) {
            x += mask_log2<T>(f.mask, mask_base, query, key);
          }
        }
        st[nt][e] = exp2f(x - lse_in_log2(lse[c]));
      }
    }

    // dV += P^T dO
    add_times_queries(dv, st, do_tile);

    // dP^T = V dO^T, then dS^T = P^T (dP^T - delta) in place of P^T.
    {
      float dpt[kMTiles][4] = {};
      keys_times_queries(dpt, sV, do_tile);
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          st[nt][e] *= dpt[nt][e] - delta[nt * 8 + 2 * t + (e & 1)];
          if constexpr (Capped) st[nt][e] *= slope[nt][e];
        }
    }

    // dK += dS^T Q; dS^T also goes to shared memory for dQ (atomic mode).
    add_times_queries(dk, st, q_tile);
    if constexpr (AtomicDq) {
#pragma unroll
      for (int nt = 0; nt < kMTiles; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<uint32_t*>(sdS + (key_row + g + 8 * h) * Tr::kDsStride + nt * 8 + 2 * t) =
              pack2<T>(st[nt][2 * h], st[nt][2 * h + 1]);
      __syncthreads();  // all of dS^T written

      // dQ += dS K: this warp's row tile of the step's queries and its share of d.
      {
        const int mt = warp % Tr::kDqWarpsM, d0 = warp / Tr::kDqWarpsM * Tr::kDqTiles * 8;
        float dq[Tr::kDqTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          // A = dS (queries x keys) from dS^T stored [key][query]: transposed 8x8 loads,
          // matrix i of the four covers queries (i & 1) * 8 and keys (i >> 1) * 8.
          uint32_t a[4];
          const int i = lane / 8;
          ldmatrix_x4_trans(a, sdS + (kk * 16 + (i >> 1) * 8 + lane % 8) * Tr::kDsStride + mt * 16 + (i & 1) * 8);
#pragma unroll
          for (int dp = 0; dp < Tr::kDqTiles / 2; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, sK + (kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * kStride + d0 + dp * 16 + (lane >> 4 << 3));
            mma_16x8x16<T>(dq[2 * dp], a, b[0], b[1]);
            mma_16x8x16<T>(dq[2 * dp + 1], a, b[2], b[3]);
          }
        }
        float* accum = p.grad_q_accum + ((batch * sh.heads_q + head) * sh.seqlen_q + seq.q0 + m0) * HeadDim + d0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mt * 16 + g + 8 * h;
          if (m0 + r >= seq.seqlen_q) continue;
#pragma unroll
          for (int dt = 0; dt < Tr::kDqTiles; ++dt)
            red_add_float2(accum + r * HeadDim + dt * 8 + 2 * t, dq[dt][2 * h], dq[dt][2 * h + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  store_key_gradients<HeadDim, T>(p, batch, head_kv, seq.k0, key0 + key_row, seq.seqlen_k, dk, dv);
}

template <int HeadDim, typename T, bool Banded, bool AtomicDq, bool Capped>
void launch_backward_kernel(const BackwardParams& p, cudaStream_t stream) {
  using Tr = BackwardTraits<HeadDim>;
  auto kernel = backward_kernel<HeadDim, T, Banded, AtomicDq, Capped>;
  constexpr int smem_bytes = Tr::kSmemElements * sizeof(T) + Tr::kSmemFloats * sizeof(float);
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const KeyBlockGrid grid = key_block_grid(p, Tr::kBlockN, sizeof(T), Banded);
  if (p.fwd.mask.tiles.lists != nullptr) sort_mask_into_key_tiles(p.fwd, Tr::kBlockN, Tr::kBlockM, stream);
  if (grid.blocks == 0) return;
  kernel<<<grid.blocks, Tr::kThreads, smem_bytes, stream>>>(p, grid.order);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

template <int HeadDim, typename T, bool Banded, bool Capped>
void launch_backward_dq_kernel(const BackwardParams& p, cudaStream_t stream) {
  using Tr = DqTraits<HeadDim>;
  auto kernel = backward_dq_kernel<HeadDim, T, Banded, Capped>;
  constexpr int smem_bytes = Tr::kSmemElements * sizeof(T);
  FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const BlockOrder order = make_query_block_order(p.fwd.shape, Tr::kBlockM, sizeof(T), Banded);
  const unsigned blocks = grid_blocks(order, p.fwd.varlen.on(), p.fwd.varlen.query_items, p.fwd.shape.heads_q);
  if (blocks == 0) return;
  kernel<<<blocks, Tr::kThreads, smem_bytes, stream>>>(p, order);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

// The key-block kernel and, deterministic, the dQ pass; run_backward_passes
// does the rest.
template <int HeadDim, typename T, bool Banded, bool Capped>
void launch_backward_main(const BackwardParams& p, cudaStream_t stream) {
  const AttentionShape& sh = p.fwd.shape;
  const bool any_keys = sh.batch * sh.heads_kv * sh.seqlen_k > 0;
  if (!p.deterministic) {
    if (any_keys) launch_backward_kernel<HeadDim, T, Banded, true, Capped>(p, stream);
    return;
  }
  if (p.head_splits != 1) throw std::invalid_argument("fusedattn: a deterministic backward takes head_splits = 1");
  if (any_keys) launch_backward_kernel<HeadDim, T, Banded, false, Capped>(p, stream);
  if (sh.batch * sh.heads_q * sh.seqlen_q > 0) launch_backward_dq_kernel<HeadDim, T, Banded, Capped>(p, stream);
}

template <int HeadDim, typename Element>
void launch_backward_sm80(const BackwardParams& p, cudaStream_t stream) {
  run_backward_passes<Element>(p, stream, [&] {
    auto with_cap = [&](auto banded) {
      constexpr bool kBanded = decltype(banded)::value;
      if (p.fwd.softcap > 0.0f)
        launch_backward_main<HeadDim, Element, kBanded, true>(p, stream);
      else
        launch_backward_main<HeadDim, Element, kBanded, false>(p, stream);
    };
    if (p.fwd.banded())
      with_cap(std::true_type{});
    else
      with_cap(std::false_type{});
  });
}

}  // namespace fusedattn::cuda
