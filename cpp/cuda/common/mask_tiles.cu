// The mask's tile lists (mask_tiles.h), in two kernels: classify gives each
// (row, key tile) one warp, which reads the tile's mask entries 16 bytes a
// lane where their layout allows and writes the tile's class; compact gives
// each row one warp, which appends the visible tiles in order. Split so that
// the reads, most of the work, spread over the whole GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "band.cuh"
#include "launch_check.h"
#include "mask.cuh"
#include "mask_tiles.h"

namespace fusedattn::cuda {
namespace {

enum : uint8_t { kTileHidden = 0, kTileWhole = 1, kTileReadsMask = 2 };

constexpr int kWarps = 8;  // per block, in both kernels

// What a warp has seen of a tile's in-band entries: any visible, all adding 0.
struct TileSeen {
  bool any = false, all = true;
  __device__ void add(float x) {
    any |= x != -INFINITY;
    all &= x == 0.0f;
  }
  __device__ bool decided() const { return any && !all; }  // it reads the mask whatever follows
  __device__ void reduce() {
    any = __any_sync(0xffffffffu, any);
    all = __all_sync(0xffffffffu, all);
  }
};

// Which of a tile's two dimensions holds its mask entries contiguously, in
// 16-byte vectors that start 16-byte aligned: the keys (a mask laid out
// [..., Nq, Nk]) or the rows (the same mask sorted by keys, whose rows are
// its keys), or neither.
enum class VectorDim : uint8_t { None, Keys, Rows };

// The entries of rows [row0, row0 + rows) x keys [col0, col0 + cols) as
// 16-byte vectors along `dim` (8 lanes per 128 bytes): the tile lies inside
// the band and the keys, and is whole along `dim`.
template <MaskKind Kind, typename T>
__device__ __forceinline__ void seen_by_vectors(TileSeen& seen, const MaskParams& m, VectorDim dim, int64_t base,
                                                int64_t row0, int64_t rows, int64_t col0, int64_t cols, int lane) {
  using Entry = MaskStorage<Kind, T>;
  constexpr int kPerVector = 16 / sizeof(Entry);
  // Vectors run along `inner` (stride 1) and repeat along `outer` (one line when its stride is 0).
  const bool along_keys = dim == VectorDim::Keys;
  const int64_t outer0 = along_keys ? row0 : col0, inner0 = along_keys ? col0 : row0;
  const int64_t outer_stride = along_keys ? m.row_stride : m.col_stride;
  const int64_t outers = outer_stride == 0 ? 1 : along_keys ? rows : cols;
  // A tile's vectors fit in 32 bits (whose division needs no library call).
  const int vectors_per_line = static_cast<int>(along_keys ? cols : rows) / kPerVector;
  const int vectors = static_cast<int>(outers) * vectors_per_line;
  // kInFlight loads a lane before it looks at them, for the memory's latency.
  constexpr int kInFlight = 4;
  union Vector {
    uint4 raw;
    Entry e[kPerVector];
  };
  for (int i0 = 0; i0 < vectors && !__any_sync(0xffffffffu, seen.decided()); i0 += 32 * kInFlight) {
    Vector v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int i = i0 + u * 32 + lane;
      const int o = i / vectors_per_line, c = i % vectors_per_line * kPerVector;
      if (i < vectors)
        v[u].raw = __ldg(reinterpret_cast<const uint4*>(static_cast<const Entry*>(m.ptr) + base +
                                                        (outer0 + o) * outer_stride + inner0 + c));
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (i0 + u * 32 + lane >= vectors) continue;
#pragma unroll
      for (int k = 0; k < kPerVector; ++k) seen.add(mask_entry<Kind, T>(v[u].e, k));
    }
  }
}

// The same one entry at a time, each row over the keys the band lets it see
// (a mask the same on every row: one row, over the keys any row sees; a mask
// the same on every key: one entry per row).
template <typename T>
__device__ __forceinline__ void seen_by_entries(TileSeen& seen, const MaskParams& m, const Band& band, int64_t base, int64_t row0,
                                int64_t rows, int64_t col0, int64_t cols, int lane) {
  const bool one_row = m.row_stride == 0;
  if (m.col_stride == 0 && !one_row) {  // a value per row (a key-padding mask sorted by keys): a lane per row
    for (int64_t r = lane; r < rows; r += 32) {
      const int64_t i = row0 + r, lo = max(col0, band.key_begin(i)), hi = min(col0 + cols, band.key_end(i));
      if (lo < hi) seen.add(mask_log2<T>(m, base, i, lo));
    }
    seen.reduce();
    return;
  }
  for (int64_t r = 0; r < (one_row ? 1 : rows) && !seen.decided(); ++r) {
    const int64_t i = row0 + r;
    const int64_t lo = max(col0, band.key_begin(one_row ? row0 : i));
    int64_t hi = min(col0 + cols, band.key_end(one_row ? row0 + rows - 1 : i));
    if (m.col_stride == 0) hi = min(hi, lo + 1);  // the row holds one value
    for (int64_t j = lo + lane; j < hi; j += 32) seen.add(mask_log2<T>(m, base, i, j));
    seen.reduce();
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarps, 1)
    classify_tiles_kernel(const __grid_constant__ ForwardParams p, uint8_t* classes, int block_m, int block_n, int64_t query_tiles,
                          int64_t heads, VectorDim vectors) {
  const MaskTiles& tiles = p.mask.tiles;
  const int lane = threadIdx.x % 32;
  const int64_t key_tile = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t r = blockIdx.y + int64_t(blockIdx.z) * gridDim.y;
  if (key_tile >= tiles.capacity || r >= tiles.rows) return;
  const int64_t query_tile = r % query_tiles, batch = r / query_tiles / heads, head = r / query_tiles % heads;
  const int64_t row0 = query_tile * block_m, rows = min(int64_t(block_m), p.shape.seqlen_q - row0);
  const int64_t col0 = key_tile * block_n, cols = min(int64_t(block_n), p.shape.seqlen_k - col0);
  const int64_t base = batch * p.mask.batch_stride + head * p.mask.head_stride;
  const Band band = Band::of(p);
  TileSeen seen;
  const bool whole_along = vectors == VectorDim::Keys ? cols == block_n : rows == block_m;
  if (vectors != VectorDim::None && whole_along && !band.cuts(row0, rows, col0, cols)) {
    dispatch_mask_kind(p.mask.kind, [&](auto kind) {
      seen_by_vectors<decltype(kind)::value, T>(seen, p.mask, vectors, base, row0, rows, col0, cols, lane);
    });
    seen.reduce();
  } else {
    seen_by_entries<T>(seen, p.mask, band, base, row0, rows, col0, cols, lane);
  }
  if (lane == 0)
    classes[r * tiles.capacity + key_tile] = !seen.any ? kTileHidden : seen.all ? kTileWhole : kTileReadsMask;
}

__global__ void __launch_bounds__(32 * kWarps) compact_tiles_kernel(const MaskTiles tiles, const uint8_t* classes) {
  const int lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= tiles.rows) return;
  const uint8_t* row_classes = classes + r * tiles.capacity;
  int32_t* list = const_cast<int32_t*>(tiles.list(r));
  int count = 0;
  for (int64_t t0 = 0; t0 < tiles.capacity; t0 += 32) {
    const uint8_t cls = t0 + lane < tiles.capacity ? row_classes[t0 + lane] : kTileHidden;
    const unsigned visible = __ballot_sync(0xffffffffu, cls != kTileHidden);
    if (cls != kTileHidden)
      list[count + __popc(visible & ((1u << lane) - 1))] = MaskTiles::entry(t0 + lane, cls == kTileReadsMask);
    count += __popc(visible);
  }
  if (lane == 0) const_cast<int32_t*>(tiles.counts)[r] = count;
}

// p with queries and keys swapped: the mask's rows are its keys, and the band
// transposed (key j sees query i iff -upper <= i - j <= -lower).
ForwardParams by_keys(const ForwardParams& p) {
  ForwardParams t = p;
  std::swap(t.shape.seqlen_q, t.shape.seqlen_k);
  std::swap(t.mask.row_stride, t.mask.col_stride);
  t.is_causal = false;
  t.window_left = p.band_right();
  t.window_right = p.window_left;
  return t;
}

// Which dimension the tiles' mask entries are read along in vectors: one of
// stride 1 whose every tile line starts 16-byte aligned.
VectorDim vector_dim(const MaskParams& m, int block_m, int block_n) {
  const int64_t size = mask_entry_bytes(m.kind);
  auto aligned = [&](int64_t elements) { return elements * size % 16 == 0; };
  if (reinterpret_cast<uintptr_t>(m.ptr) % 16 != 0 || !aligned(m.batch_stride) || !aligned(m.head_stride))
    return VectorDim::None;
  if (m.col_stride == 1 && aligned(m.row_stride) && aligned(block_n)) return VectorDim::Keys;
  if (m.row_stride == 1 && aligned(m.col_stride) && aligned(block_m)) return VectorDim::Rows;
  return VectorDim::None;
}

}  // namespace

MaskTiles mask_tiles_layout(const ForwardParams& p, int block_m, int block_n) {
  const AttentionShape& sh = p.shape;
  const int64_t query_tiles = (sh.seqlen_q + block_m - 1) / block_m;
  const int64_t heads = p.mask.head_stride == 0 ? 1 : sh.heads_q;
  const int64_t batches = p.mask.batch_stride == 0 ? 1 : sh.batch;
  MaskTiles t;
  t.capacity = (sh.seqlen_k + block_n - 1) / block_n;
  t.head_stride = heads == 1 ? 0 : query_tiles;
  t.batch_stride = batches == 1 ? 0 : heads * query_tiles;
  t.rows = batches * heads * query_tiles;
  return t;
}

int64_t mask_tiles_class_bytes(const MaskTiles& layout) { return layout.rows * layout.capacity; }

MaskTiles mask_tiles_layout_by_keys(const ForwardParams& p, int block_keys, int block_queries) {
  return mask_tiles_layout(by_keys(p), block_keys, block_queries);
}

void sort_mask_into_key_tiles(const ForwardParams& p, int block_keys, int block_queries, cudaStream_t stream) {
  sort_mask_into_tiles(by_keys(p), block_keys, block_queries, stream);
}

void sort_mask_into_tiles(const ForwardParams& p, int block_m, int block_n, cudaStream_t stream) {
  const MaskTiles& t = p.mask.tiles;
  if (t.rows == 0) return;
  if (t.lists == nullptr || t.counts == nullptr || t.classes == nullptr)
    throw std::invalid_argument("fusedattn: the mask's tile lists have no storage");
  if (t.capacity == 0) {  // no tile to visit (a backward over no queries still walks its key blocks)
    FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(const_cast<int32_t*>(t.counts), 0, t.rows * sizeof(int32_t), stream));
    return;
  }
  const int64_t query_tiles = (p.shape.seqlen_q + block_m - 1) / block_m;
  const int64_t heads = t.head_stride == 0 ? 1 : p.shape.heads_q;
  // Rows over grid y and z (y holds at most 65535).
  const dim3 grid(static_cast<unsigned>((t.capacity + kWarps - 1) / kWarps), static_cast<unsigned>(std::min<int64_t>(t.rows, 65535)),
                  static_cast<unsigned>((t.rows + 65534) / 65535));
  const VectorDim vectors = vector_dim(p.mask, block_m, block_n);
  auto classify = [&](auto element) {
    classify_tiles_kernel<decltype(element)><<<grid, 32 * kWarps, 0, stream>>>(p, t.classes, block_m, block_n,
                                                                                query_tiles, heads, vectors);
  };
  if (p.dtype == DType::BFloat16)
    classify(__nv_bfloat16{});
  else
    classify(__half{});
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
  compact_tiles_kernel<<<static_cast<unsigned>((t.rows + kWarps - 1) / kWarps), 32 * kWarps, 0, stream>>>(t, t.classes);
  FUSEDATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fusedattn::cuda
