// Split-KV attention for decoding (flash decoding) on mma.sync tensor cores.
//
// One thread block per (16 query rows, split, kv head, sequence). The rows are
// the (query head, query) pairs of one kv head's group, so every K/V tile is
// loaded once for all query heads that read it (GQA). The block's keys, its
// share of the sequence's cache_seqlens[b] + n_new, stream through a ring of
// kStages shared-memory buffers with cp.async: kStages - 1 tiles are always in
// flight, which is what a memory-bound kernel needs. Each warp (8, or 4 at
// d=128 where a block cannot hold 8 warps' ring: the planner's choice) takes 16 keys
// of every tile (128 or 64 keys), copies them itself
// (its own share of the ring: no block-wide sync per tile, so a warp runs
// ahead of a slower one) and keeps its own online softmax (m_i, l_i, acc);
// the warps merge in shared memory at the end:
//   S   = (scale log2 e) Q K_w^T;  m' = max(m, rowmax S);  P = 2^(S - m')
//   l   = 2^(m - m') l + rowsum P;  acc = 2^(m - m') acc + P V_w
//   out = sum_w 2^(m_w - M) acc_w / sum_w 2^(m_w - M) l_w,  M = max_w m_w
// With one split the block writes out and lse; with several, either the
// splits of a row tile run as one thread block cluster and merge from each
// other's shared memory, or each writes float32 partials and the last of them
// to finish merges them (merge_splits).
#pragma once

#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../hopper/dependent_launch.cuh"
#include "../common/band.cuh"
#include "../common/device_math.cuh"
#include "../common/launch_check.h"
#include "../common/online_softmax.cuh"
#include "../common/tile_loads.cuh"
#include "../tile_size.h"
#include "forward_kvcache.h"
#include "kvcache_common.cuh"
#include "merge_splits.cuh"

namespace fusedattn::cuda {

template <int HeadDim, int Warps>
struct DecodeTraits {
  // 8 warps, 128-key tiles: a wait, a sync and a softmax step per 32 KB of K
  // and V instead of per 16 KB. At d <= 64 that is 2 blocks per SM; at d=128
  // the ring takes 192 KB, one block per SM holding the bytes in flight of
  // two 4-warp blocks, with half the splits to merge. (The planner picks 8
  // or, where a block cannot hold 8 warps' ring, 4.) The figures behind
  // these traits: docs/tuning.md.
  static constexpr int kWarps = Warps;
  static constexpr int kMinBlocksPerSm = HeadDim * Warps <= 512 ? 2 : 1;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kDecodeBlockM;  // query rows: one MMA tile, shared by the warps
  static constexpr int kBlockN = decode_block_n(kWarps);  // keys per tile, 16 per warp
  static_assert(kBlockM == 16 && kBlockN % kDecodeBlockN == 0);
  // Tiles in the ring: kStages - 1 in flight while one is computed on. 2
  // stages keep too few bytes in flight per block, and 4 leave room for only
  // one block per SM, which cannot keep the SM's share in flight.
  static constexpr int kStages = 3;
  // Each 16-byte cp.async asks L2 for the surrounding 128 bytes (the
  // .L2::128B hint), which reads slightly faster. Per-row bulk copies into
  // the ring read slower than cp.async, and prefetches of later tiles into L2
  // compete with the real requests.
  static constexpr int kL2Prefetch = 128;
  // Shared-memory rows are unpadded and swizzled (swizzled_offset): a
  // 128-byte line of the cache lands in one line of shared memory, so its
  // copies reach L2 as one request per line (padded rows split every other
  // line in two).
  static constexpr int kChunksPerRow = HeadDim / 8;  // 16-byte chunks
  // A tile as the copies (a warp's share: 32 threads) and ldmatrix see it.
  struct Layout {
    static constexpr int kThreads = 32, kChunksPerRow = DecodeTraits::kChunksPerRow, kStride = HeadDim;
    static constexpr bool kSwizzled = true;
  };
  static constexpr int kTileElements = kBlockN * HeadDim;
  static constexpr int kSmemElements = kBlockM * HeadDim + kStages * 2 * kTileElements;  // Q, ring
  // The epilogue reuses the ring: per warp its rows (float32, padded so the
  // float2 stores of a half-warp hit 32 banks) and their m, l; then the flag
  // that says whether this block merges the splits.
  static constexpr int kAccStride = HeadDim + 8;
  static constexpr int kEpilogueBytes = kWarps * kBlockM * (kAccStride + 2) * 4 + 4;
  // Merging in a cluster, the block's partial rows and LSEs follow, 16-byte
  // aligned, for the other blocks to read.
  static constexpr int kPartialOffset = (kEpilogueBytes + 15) / 16 * 16;
  static_assert(kPartialOffset + kBlockM * (HeadDim + 1) * 4 <= kStages * 2 * kTileElements * 2,
                "epilogue must fit in the ring");
  static_assert(HeadDim % 16 == 0, "MMA tiles are 16 wide");
};

// A block's dynamic shared memory (Q and the ring), for the launch and the
// occupancy queries.
template <int HeadDim, int Warps, typename T>
constexpr int decode_smem_bytes() {
  return DecodeTraits<HeadDim, Warps>::kSmemElements * sizeof(T);
}

// As many blocks per SM as the ring's shared memory allows: 2 at d <= 64 and
// with 4 warps at d=128, 1 with 8 warps at d=128. The hint of 2 keeps the
// 4-warp kernel from spilling: without it ptxas holds that kernel to 168
// registers on sm_90a. Sides (the band's tested sides) and Paged are fixed
// at compile time, so a tile's loop holds only the tests its call needs.
template <int HeadDim, int Warps, typename T, BandSides Sides, bool Paged>
__global__ void __launch_bounds__(DecodeTraits<HeadDim, Warps>::kThreads,
                                  DecodeTraits<HeadDim, Warps>::kMinBlocksPerSm)
    decode_kernel(const __grid_constant__ KVCacheParams p) {
  using Tr = DecodeTraits<HeadDim, Warps>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN;
  using Layout = typename Tr::Layout;
  constexpr int kStages = Tr::kStages, kWarps = Tr::kWarps, kDTiles = HeadDim / 8;
  constexpr bool kBanded = Sides != BandSides::kNone, kLeftSide = Sides == BandSides::kBoth;

  extern __shared__ __align__(128) unsigned char smem_raw[];  // 128-byte lines (swizzled_offset)
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sRing = sQ + kBlockM * HeadDim;  // stage i: K tile at 2i, V tile at 2i + 1

  // Launched as a dependent launch (dependent_launch.cuh): nothing global is
  // read or written before the previous kernel on the stream has finished.
  wait_for_previous_grid();
  const ForwardParams& a = p.attn;
  const AttentionShape& sh = a.shape;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group and column pair

  // Flat grid, row tiles fastest (they read the same K/V), then splits, kv
  // heads, sequences; in clusters the splits come first (a cluster is
  // num_splits consecutive blocks). 32-bit division: the launch checks the
  // grid fits 2^31.
  const int64_t group = sh.heads_q / sh.heads_kv;
  const int64_t group_rows = group * sh.seqlen_q;  // rows reading this kv head
  const unsigned row_tiles = static_cast<unsigned>(decode_row_tiles(sh));
  const unsigned splits = static_cast<unsigned>(p.num_splits);
  const bool splits_in_cluster = p.merge_in_cluster;
  unsigned index = blockIdx.x;
  const unsigned row_tile = splits_in_cluster ? index / splits % row_tiles : index % row_tiles;
  const unsigned split = splits_in_cluster ? index % splits : index / row_tiles % splits;
  index /= row_tiles * splits;
  const unsigned head_kv = index % static_cast<unsigned>(sh.heads_kv);
  const unsigned batch = index / static_cast<unsigned>(sh.heads_kv);

  const int64_t row0 = int64_t(row_tile) * kBlockM;  // first row within the group
  const int rows = static_cast<int>(min(int64_t(kBlockM), group_rows - row0));
  // Row r of the group is query r % Nq of head head_kv * group + r / Nq, so the
  // group's rows are consecutive in [B, Hq, Nq] (out, lse, partials).
  const int64_t first_row = (int64_t(batch) * sh.heads_q + head_kv * group) * sh.seqlen_q + row0;

  const int64_t length = kv_length(p, batch);  // -1: invalid
  // Banded, query i sees keys [band.key_begin(i), band.key_end(i))
  // (common/band.cuh); the splits share the tiles from the one holding the
  // first query's first key, and keys in [unmasked_begin, unmasked_end) are
  // seen by every row, so only the tiles at the band's edges pay for masking.
  const Band band = Band::of(a, max(length, int64_t(0)));
  const int64_t first_tile = kLeftSide ? band.key_begin(0) / kBlockN : 0;
  const int64_t n_tiles = length > 0 ? (length + kBlockN - 1) / kBlockN : 0;
  const int64_t tiles_per_split = (n_tiles - first_tile + p.num_splits - 1) / p.num_splits;
  const int64_t tile_begin = min(n_tiles, first_tile + split * tiles_per_split);
  const int64_t tile_end = min(n_tiles, tile_begin + tiles_per_split);
  const int64_t unmasked_begin = kLeftSide ? band.key_begin(sh.seqlen_q - 1) : 0;
  const int64_t unmasked_end = kBanded ? band.key_end(0) : length;

  const T* q = static_cast<const T*>(a.q) + batch * a.q_strides.batch;
  // A paged cache's sequence starts nowhere: each tile finds its page (PageCursor).
  const int64_t kv_batch = Paged ? 0 : batch;
  const T* k = static_cast<const T*>(a.k) + kv_batch * a.k_strides.batch + head_kv * a.k_strides.head;
  const T* v = static_cast<const T*>(a.v) + kv_batch * a.v_strides.batch + head_kv * a.v_strides.head;

  // Q: gather the block's (head, query) rows; rows past the group are zero.
  for (int c = threadIdx.x; c < kBlockM * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = c % Tr::kChunksPerRow * 8;
    const int64_t row = row0 + r;
    const int64_t head = head_kv * group + row / sh.seqlen_q, query = row % sh.seqlen_q;
    const bool valid = r < rows;
    cp_async_16(sQ + tile_offset<Layout>(r, col),
                valid ? q + head * a.q_strides.head + query * a.q_strides.row + col : q, valid);
  }
  cp_async_commit();

  // Each warp copies its own 16 keys of K and V and commits a group per tile
  // (empty past the end), so the wait count below holds on every iteration.
  // Tiles whose 16 rows are all valid take load_full_rows_async with this
  // lane's source pointers, which advance one tile per load; the sequence's
  // last tile takes load_rows_async, which zero-fills rows past the end.
  constexpr int kLaneRowStep = RowChunk<Layout>::kRowStep;  // rows between a lane's copies
  const RowChunk<Layout> chunk(lane);
  const int64_t lane_row = int64_t(tile_begin) * kBlockN + warp * 16 + chunk.row;
  const T* k_lane = k + lane_row * a.k_strides.row + chunk.col;
  const T* v_lane = v + lane_row * a.v_strides.row + chunk.col;
  const int64_t k_lane_step = kLaneRowStep * a.k_strides.row, v_lane_step = kLaneRowStep * a.v_strides.row;
  const int64_t k_tile_step = kBlockN * a.k_strides.row, v_tile_step = kBlockN * a.v_strides.row;
  // Paged, the warp's 16 keys of a tile lie in one page (pages hold a
  // multiple of 16 positions): its table entry is read one tile ahead.
  PageCursor<Paged> pages(p, batch, warp * 16, length, tile_begin < tile_end ? tile_begin * kBlockN : length);
  int load_stage = 0;  // the stage the next load fills
  auto load_tile = [&](int64_t tile) {
    if (tile < tile_end) {
      T* sK = sRing + 2 * load_stage * Tr::kTileElements + warp * 16 * HeadDim;
      T* sV = sK + Tr::kTileElements;
      const int64_t key0 = tile * kBlockN + warp * 16;
      const T* k_rows = k;  // where row key_row of the warp's keys is key0
      const T* v_rows = v;
      int64_t key_row = key0;
      if constexpr (Paged) {
        const auto at = pages.next(tile + 1 < tile_end ? (tile + 1) * kBlockN : length);
        k_rows += at.page * a.k_strides.batch;
        v_rows += at.page * a.v_strides.batch;
        key_row = at.row;
        k_lane = k_rows + (key_row + chunk.row) * a.k_strides.row + chunk.col;
        v_lane = v_rows + (key_row + chunk.row) * a.v_strides.row + chunk.col;
      }
      if (length - key0 >= 16) {
        load_full_rows_async<16, Layout, Tr::kL2Prefetch>(sK, k_lane, k_lane_step, lane);
        load_full_rows_async<16, Layout, Tr::kL2Prefetch>(sV, v_lane, v_lane_step, lane);
      } else {
        load_rows_async<16, Layout, Tr::kL2Prefetch>(sK, k_rows, a.k_strides.row, key_row, length - key0, lane);
        load_rows_async<16, Layout, Tr::kL2Prefetch>(sV, v_rows, a.v_strides.row, key_row, length - key0, lane);
      }
      k_lane += k_tile_step;
      v_lane += v_tile_step;
      load_stage = load_stage == kStages - 1 ? 0 : load_stage + 1;
    }
    cp_async_commit();
  };
  // Waits for the warp's rows of the tile; the __syncwarp makes every lane's
  // copies visible to the warp, and orders the warp's reads of the stage that
  // the next load_tile refills before that refill.
  auto wait_tile = [&] {
    cp_async_wait<kStages - 2>();
    __syncwarp();
  };
  for (int i = 0; i < kStages - 1; ++i) load_tile(tile_begin + i);

  cp_async_wait<kStages - 1>();  // Q landed (the tiles' groups came after it)
  __syncthreads();
  uint32_t q_frag[HeadDim / 16][4];
#pragma unroll
  for (int kk = 0; kk < HeadDim / 16; ++kk)
    ldmatrix_x4(q_frag[kk], sQ + tile_offset<Layout>(lane % 16, kk * 16 + lane / 16 * 8));

  // The queries of this thread's two rows (g, g + 8), for the band.
  int64_t query[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) query[h] = (row0 + g + 8 * h) % sh.seqlen_q;

  float acc[kDTiles][4] = {};
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {};
  const SoftCap cap = SoftCap::of(a);
  const float scale_log2 = cap.scale_log2;

  int read_stage = 0;  // the stage this iteration computes on
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    wait_tile();
    load_tile(tile + kStages - 1);
    const T* sK = sRing + 2 * read_stage * Tr::kTileElements + warp * 16 * HeadDim;
    read_stage = read_stage == kStages - 1 ? 0 : read_stage + 1;
    const T* sV = sK + Tr::kTileElements;

    // S = Q K^T for this warp's 16 keys: two n-tiles.
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < HeadDim / 16; ++kk) {
      uint32_t b[4];
      ldmatrix_x4(b, sK + tile_offset<Layout>((lane & 7) + (lane >> 4 << 3), kk * 16 + ((lane >> 3) & 1) * 8));
      mma_16x8x16<T>(s[0], q_frag[kk], b[0], b[1]);
      mma_16x8x16<T>(s[1], q_frag[kk], b[2], b[3]);
    }

    if (cap.on()) cap.apply(s);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
    const int64_t key0 = tile * kBlockN + warp * 16;
    if ((kLeftSide && key0 < unmasked_begin) || key0 + 16 > unmasked_end) {
      // Warp-local bounds as 32-bit ints: key column c is past the sequence
      // when c >= cols, and outside row h's band when c < lo[h] or c > hi[h].
      const int cols = static_cast<int>(min(int64_t(16), length - key0));
      int lo[2] = {0, 0}, hi[2] = {16, 16};
      if constexpr (kBanded) {
#pragma unroll
        for (int h = 0; h < 2; ++h) band.local(query[h], key0, 17, lo[h], hi[h]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nt * 8 + 2 * t + (e & 1);
          if (c >= cols || (kLeftSide && c < lo[e >> 1]) || c > hi[e >> 1]) s[nt][e] = -INFINITY;
        }
    }
    online_softmax_step(s, m_i, l_i, acc);

    // acc += P V for the same 16 keys.
    uint32_t p_frag[4];
    probabilities_as_a<T>(p_frag, s, 0);
#pragma unroll
    for (int dp = 0; dp < HeadDim / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV + tile_offset<Layout>((lane & 7) + (((lane >> 3) & 1) << 3), dp * 16 + (lane >> 4 << 3)));
      mma_16x8x16<T>(acc[2 * dp], p_frag, b[0], b[1]);
      mma_16x8x16<T>(acc[2 * dp + 1], p_frag, b[2], b[3]);
    }
  }
  // The next kernel may be scheduled once every block of this grid has
  // passed here or exited (it still waits for this kernel's writes). At the
  // kernel's start that would be as soon as the last wave began, and the next
  // kernel's blocks would sit at their wait beside it, holding shared memory.
  allow_dependent_launch();
  cp_async_wait<0>();
  // The ring is free; a page outside the cache makes the sequence invalid.
  const bool invalid = __syncthreads_or(pages.bad) || length < 0;

  // Merge the warps: each stores its rows rescaled to the block's running max
  // M (computed from every warp's m) and its l; then each thread sums 8
  // columns of one row over the warps and writes them with 16-byte stores.
  float* sAcc = reinterpret_cast<float*>(sRing);  // [kWarps][kBlockM][kAccStride]
  float* sM = sAcc + kWarps * kBlockM * Tr::kAccStride;  // [kWarps][kBlockM]
  float* sL = sM + kWarps * kBlockM;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_i[h]);
    if (t == 0) {
      sM[warp * kBlockM + g + 8 * h] = m_i[h];
      sL[warp * kBlockM + g + 8 * h] = l;
    }
  }
  __syncthreads();
  // Block max of a row, and warp w's factor 2^(m_w - M) (0 for a warp that saw no key).
  auto block_max = [&](int r) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sM[w * kBlockM + r]);
    return m;
  };
  auto factor = [](float m_w, float m) { return m_w == -INFINITY ? 0.0f : exp2f(m_w - m); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    const float f = factor(m_i[h], block_max(r));
    float* dst = sAcc + (warp * kBlockM + r) * Tr::kAccStride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * h] * f, acc[dt][2 * h + 1] * f);
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
  float* sPartial = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sRing) + Tr::kPartialOffset);
  float* sPartialLse = sPartial + kBlockM * HeadDim;  // [kBlockM]
  for (int c = threadIdx.x; c < kBlockM * Tr::kChunksPerRow; c += Tr::kThreads) {
    const int r = c / Tr::kChunksPerRow, col = c % Tr::kChunksPerRow * 8;
    if (r >= rows) continue;
    float m = block_max(r);
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) l += sL[w * kBlockM + r] * factor(sM[w * kBlockM + r], m);
    const int64_t row = first_row + r;
    // The sink joins the sum once: here with one split, else in the merge.
    const float acc_scale =
        direct ? add_valueless_logit(sink_in_log2(a.sinks, row / sh.seqlen_q % sh.heads_q), m, l) : 1.0f;
    const float inv = invalid ? NAN : l > 0.0f ? acc_scale / l : 0.0f;
    float o[8] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* src = sAcc + (w * kBlockM + r) * Tr::kAccStride + col;
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] += src[j];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] *= inv;
    const float lse = invalid ? NAN : lse_from_log2(m, l);
    if (direct) {
      T* out = static_cast<T*>(a.out) + output_offset(a, row) + col;
      uint4 packed;
      uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
      for (int j = 0; j < 4; ++j) words[j] = pack2<T>(o[2 * j], o[2 * j + 1]);
      *reinterpret_cast<uint4*>(out) = packed;
      if (col == 0) a.lse[row] = lse;
    } else if (splits_in_cluster) {
      float4* out = reinterpret_cast<float4*>(sPartial + r * HeadDim + col);
      out[0] = make_float4(o[0], o[1], o[2], o[3]);
      out[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (col == 0) sPartialLse[r] = lse;
    } else {
      const int64_t rows_total = sh.batch * sh.heads_q * sh.seqlen_q;
      float4* out = reinterpret_cast<float4*>(p.partial_out + (split * rows_total + row) * HeadDim + col);
      out[0] = make_float4(o[0], o[1], o[2], o[3]);
      out[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (col == 0) p.partial_lse[split * rows_total + row] = lse;
    }
  }
  if (direct) return;

  if (splits_in_cluster) {
    // Block s of the cluster (split s) merges rows s, s + splits, ..., a warp
    // each, from every block's shared memory; none leaves while another may
    // still read its rows.
    cluster_sync();
    for (int r = int(split) + warp * int(splits); r < rows; r += kWarps * int(splits))
      merge_splits<T>(p, first_row + r, lane, ClusterPartials{sPartialLse + r, sPartial + r * HeadDim});
    cluster_sync();
    return;
  }

  // Count this split in; the last of the (sequence, kv head, row tile)'s
  // num_splits blocks to finish merges their partials, while the others
  // still stream: a combine kernel after this one would add its own launch
  // and pass to every step.
  int* last = reinterpret_cast<int*>(sL + kWarps * kBlockM);
  __threadfence();  // this block's partials reach L2 before its count
  __syncthreads();
  const int64_t item = (int64_t(batch) * sh.heads_kv + head_kv) * row_tiles + row_tile;
  if (threadIdx.x == 0) *last = atomicAdd(p.split_arrivals + item, 1) == p.num_splits - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();  // the other splits' partials, read through L2 by merge_splits
  for (int r = warp; r < rows; r += kWarps) merge_splits<T>(p, first_row + r, lane, GlobalPartials(p, first_row + r));
  if (threadIdx.x == 0) p.split_arrivals[item] = 0;  // as the next launch expects it
}

// Raises the kernel's dynamic shared memory limit and asks whether it can be
// a dependent launch, once per device (the attribute is per device; setting
// it costs a driver call per launch otherwise). Returns that answer.
template <int HeadDim, int Warps, typename T, BandSides Sides, bool Paged>
bool configure_decode_kernel() {
  enum : int { kPlain = 1, kDependent = 2 };
  static std::atomic<int> configured[kMaxCachedDevices];
  return once_per_device(configured, [](int device) {
           const auto kernel = decode_kernel<HeadDim, Warps, T, Sides, Paged>;
           FUSEDATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     decode_smem_bytes<HeadDim, Warps, T>()));
           return waits_for_previous_grid(reinterpret_cast<const void*>(kernel), device) ? kDependent : kPlain;
         }) == kDependent;
}

// Whether the current device gives a block of `warps` warps the shared
// memory of its ring (8 warps at d=128 take 192 KB; sm_80 gives a block 163 KB).
template <int HeadDim, typename T>
bool decode_warps_fit(int warps) {
  if (warps != 8 && !(warps == 4 && HeadDim > 64)) return false;  // the instantiated counts
  // Per device: 1 no, 2 yes (once_per_device keeps no zero answer).
  static std::atomic<int> known[2][kMaxCachedDevices];
  return once_per_device(known[warps == 8], [warps](int device) {
           int optin = 0;
           FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
           return optin >= (warps == 8 ? decode_smem_bytes<HeadDim, 8, T>() : decode_smem_bytes<HeadDim, 4, T>()) ? 2
                                                                                                                  : 1;
         }) == 2;
}

// f(std::integral_constant<int, warps>{}): 8 warps everywhere, 4 at d=128 too.
template <int HeadDim, typename F>
decltype(auto) with_decode_warps(int warps, F&& f) {
  if (warps == 8) return f(std::integral_constant<int, 8>{});
  if constexpr (HeadDim > 64) {
    if (warps == 4) return f(std::integral_constant<int, 4>{});
  }
  throw_planner_bug("no decode block of " + std::to_string(warps) + " warps at head dim " + std::to_string(HeadDim));
}

template <int HeadDim, int Warps, typename T, BandSides Sides, bool Paged>
void launch_decode_kernel(const KVCacheParams& p, const Plan& plan, cudaStream_t stream) {
  using Tr = DecodeTraits<HeadDim, Warps>;
  // Where the kernel's sm_90 code runs on this device, it may wait for the
  // kernel before it and run in clusters (where the plan says).
  const bool hopper = configure_decode_kernel<HeadDim, Warps, T, Sides, Paged>();
  const int64_t blocks = decode_items(p.attn.shape) * p.num_splits;
  if (blocks > kMaxDecodeGrid) throw_planner_bug("B x Hkv x splits x row tiles exceeds one launch (2^31 - 1)");
  if ((p.merge_in_cluster || plan.dependent_launch) && !hopper)
    throw_planner_bug("merge_in_cluster and a dependent launch need the decode kernel's sm_90 code");
  launch_dependent(decode_kernel<HeadDim, Warps, T, Sides, Paged>, plan.dependent_launch,
                   p.merge_in_cluster ? p.num_splits : 1, dim3(static_cast<unsigned>(blocks)), dim3(Tr::kThreads),
                   decode_smem_bytes<HeadDim, Warps, T>(), stream, p);
}

template <int HeadDim, typename Element>
void launch_decode(const KVCacheParams& p, const Plan& plan, cudaStream_t stream) {
  with_decode_warps<HeadDim>(plan.warps, [&](auto warps) {
    with_band_sides(band_sides(p.attn), [&](auto sides) {
      if (p.block_table != nullptr)
        launch_decode_kernel<HeadDim, warps, Element, sides, true>(p, plan, stream);
      else
        launch_decode_kernel<HeadDim, warps, Element, sides, false>(p, plan, stream);
    });
  });
}

// Whether blocks of `warps` warps run the kernel's sm_90 code on the current
// device, so that each may start while the kernel before it ends (every
// variant gives one answer).
template <int HeadDim, typename Element>
bool decode_dependent_launch(int warps) {
  return with_decode_warps<HeadDim>(warps, [](auto warps) {
    return configure_decode_kernel<HeadDim, decltype(warps)::value, Element, BandSides::kBoth, true>();
  });
}

// The variants (band sides, paging) differ in registers (186-224 at d=128 on
// sm_90a), but the launch bounds and the ring's shared memory fix their
// blocks per SM alike, so one variant's answer serves all. Asked of the
// driver once per device (at least 1: once_per_device keeps no zero answer).
template <int HeadDim, typename Element>
int decode_blocks_per_sm(int warps) {
  return with_decode_warps<HeadDim>(warps, [](auto warps) {
    constexpr int kWarps = decltype(warps)::value;
    using Tr = DecodeTraits<HeadDim, kWarps>;
    static std::atomic<int> known[kMaxCachedDevices];
    return once_per_device(known, [](int) {
      configure_decode_kernel<HeadDim, kWarps, Element, BandSides::kBoth, true>();
      int blocks = 0;
      FUSEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, decode_kernel<HeadDim, kWarps, Element, BandSides::kBoth, true>, Tr::kThreads,
          decode_smem_bytes<HeadDim, kWarps, Element>()));
      return std::max(blocks, 1);
    });
  });
}

// The variants again share one answer (at d=128 with 8 warps 186-224
// registers: 1 block per SM either way). Cached per device and split
// count (plus one: once_per_device keeps no zero answer).
template <int HeadDim, typename Element>
int decode_max_active_clusters(int warps, int splits) {
  return with_decode_warps<HeadDim>(warps, [splits](auto warps) {
    constexpr int kWarps = decltype(warps)::value;
    using Tr = DecodeTraits<HeadDim, kWarps>;
    if (splits < 2 || splits > kMaxClusterSplits ||
        !configure_decode_kernel<HeadDim, kWarps, Element, BandSides::kBoth, true>())
      return 0;
    static std::atomic<int> known[kMaxClusterSplits + 1][kMaxCachedDevices];
    return once_per_device(known[splits], [splits](int) {
             cudaLaunchConfig_t config = {};
             config.gridDim = dim3(splits);
             config.blockDim = dim3(Tr::kThreads);
             config.dynamicSmemBytes = decode_smem_bytes<HeadDim, kWarps, Element>();
             cudaLaunchAttribute attribute = cluster_attribute(splits);
             config.attrs = &attribute;
             config.numAttrs = 1;
             int clusters = 0;
             FUSEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveClusters(
                 &clusters, decode_kernel<HeadDim, kWarps, Element, BandSides::kBoth, true>, &config));
             return clusters + 1;
           }) -
           1;
  });
}

}  // namespace fusedattn::cuda
