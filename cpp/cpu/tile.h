// Tiles of one (batch, head) attention problem on the CPU: loading rows of
// q/k/v as float32, writing results back, and masking a tile of base-2 scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "blas.h"
#include "fusedattn/params.h"

namespace fusedattn::cpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows [row0, row0 + rows) of the query axis by keys [col0, col0 + cols).
struct Tile {
  int64_t row0, rows, col0, cols;
};

// Start of head `head` of batch `batch` in a [B, H, N, d] tensor.
template <typename T, typename Ptr>
T* head_ptr(Ptr base, const TensorStrides& s, int64_t batch, int64_t head) {
  return static_cast<T*>(base) + batch * s.batch + head * s.head;
}

// Rows [row0, row0 + rows) of a head as a float32 [rows x d] matrix. float32
// inputs are read in place; other dtypes are converted into `buffer`.
template <typename scalar_t>
Matrix view_rows(const scalar_t* head, int64_t row_stride, int64_t row0, int64_t rows, int64_t d,
                 std::vector<float>& buffer) {
  const scalar_t* src = head + row0 * row_stride;
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {src, row_stride};
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < d; ++c) buffer[r * d + c] = static_cast<float>(src[r * row_stride + c]);
    return {buffer.data(), d};
  }
}

// The same rows times `multiplier`, always copied: [rows x d] into dst.
template <typename scalar_t>
Matrix copy_rows(const scalar_t* head, int64_t row_stride, int64_t row0, int64_t rows, int64_t d,
                 float multiplier, std::vector<float>& dst) {
  const scalar_t* src = head + row0 * row_stride;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = static_cast<float>(src[r * row_stride + c]) * multiplier;
  return {dst.data(), d};
}

// The same rows transposed: [d x rows] into dst, row stride ld_dst.
template <typename scalar_t>
Matrix copy_rows_transposed(const scalar_t* head, int64_t row_stride, int64_t row0, int64_t rows,
                            int64_t d, int64_t ld_dst, std::vector<float>& dst) {
  const scalar_t* src = head + row0 * row_stride;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) dst[c * ld_dst + r] = static_cast<float>(src[r * row_stride + c]);
  return {dst.data(), ld_dst};
}

// dst[c][r] = src[r][c] for a [rows x cols] float32 tile.
inline Matrix transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src,
                        std::vector<float>& dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  return {dst.data(), ld_dst};
}

// dst row r = src row r * row_scale[r] (or 1 when row_scale is null), cast to scalar_t.
template <typename scalar_t>
void store_rows(scalar_t* head, int64_t row_stride, int64_t row0, int64_t rows, int64_t d,
                const float* src, const float* row_scale = nullptr) {
  for (int64_t r = 0; r < rows; ++r) {
    const float a = row_scale ? row_scale[r] : 1.0f;
    scalar_t* dst = head + (row0 + r) * row_stride;
    for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<scalar_t>(src[r * d + c] * a);
  }
}

// The band of keys query i sees under is_causal and the window: [begin, end),
// clamped to the keys. Both ends grow with i.
inline int64_t row_key_begin(const ForwardParams& p, int64_t i) {
  if (p.window_left < 0) return 0;
  return std::clamp<int64_t>(i + p.shape.causal_offset() - p.window_left, 0, p.shape.seqlen_k);
}

inline int64_t row_key_end(const ForwardParams& p, int64_t i) {
  const int64_t right = p.band_right();
  if (right < 0) return p.shape.seqlen_k;
  return std::clamp<int64_t>(i + p.shape.causal_offset() + right + 1, 0, p.shape.seqlen_k);
}

// The queries that see some key of [col0, col0 + cols): [begin, end).
inline std::pair<int64_t, int64_t> visible_queries(const ForwardParams& p, int64_t col0, int64_t cols) {
  const int64_t offset = p.shape.causal_offset(), right = p.band_right(), nq = p.shape.seqlen_q;
  const int64_t begin = right < 0 ? 0 : std::clamp<int64_t>(col0 - offset - right, 0, nq);
  const int64_t end = p.window_left < 0 ? nq : std::clamp<int64_t>(col0 + cols - offset + p.window_left, 0, nq);
  return {begin, std::max(begin, end)};
}

// Whether the band hides some (row, key) pair of the tile.
inline bool tile_crosses_band(const ForwardParams& p, const Tile& t) {
  return t.col0 < row_key_begin(p, t.row0 + t.rows - 1) || t.col0 + t.cols > row_key_end(p, t.row0);
}

template <typename mask_t>
const mask_t* mask_row(const MaskParams& m, int64_t batch, int64_t head, int64_t row) {
  return static_cast<const mask_t*>(m.ptr) + batch * m.batch_stride + head * m.head_stride +
         row * m.row_stride;
}

// What attn_mask does to a tile (the CUDA kernels' classes, cuda/common/mask_tiles.h):
// hides every entry (the tile is skipped), adds 0 to every entry (whole: the
// mask is not applied), or neither (read).
enum class MaskTile { Hidden, Whole, Read };

template <typename mask_t>
MaskTile classify(const MaskParams& m, int64_t batch, int64_t head, const Tile& t) {
  bool any = false, all = true;  // any entry visible; every entry adds 0
  for (int64_t r = 0; r < t.rows && !(any && !all); ++r) {
    const mask_t* row = mask_row<mask_t>(m, batch, head, t.row0 + r);
    for (int64_t c = 0; c < t.cols; ++c) {
      const mask_t v = row[(t.col0 + c) * m.col_stride];
      if constexpr (std::is_same_v<mask_t, bool>) {
        any |= v;
        all &= v;
      } else {
        any |= static_cast<float>(v) != kNegInf;
        all &= static_cast<float>(v) == 0.0f;
      }
    }
  }
  return !any ? MaskTile::Hidden : all ? MaskTile::Whole : MaskTile::Read;
}

template <typename scalar_t>
MaskTile classify_mask_tile(const MaskParams& m, int64_t batch, int64_t head, const Tile& t) {
  switch (m.kind) {
    case MaskKind::None: return MaskTile::Whole;
    case MaskKind::Bool: return classify<bool>(m, batch, head, t);
    case MaskKind::AdditiveFloat32: return classify<float>(m, batch, head, t);
    case MaskKind::AdditiveInput: return classify<scalar_t>(m, batch, head, t);
  }
  return MaskTile::Read;
}

template <typename mask_t>
void apply_mask(float* s, int64_t lds, const MaskParams& m, int64_t batch, int64_t head,
                const Tile& t) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const mask_t* row = mask_row<mask_t>(m, batch, head, t.row0 + r) + t.col0 * m.col_stride;
    float* s_row = s + r * lds;
    for (int64_t c = 0; c < t.cols; ++c) {
      const mask_t v = row[c * m.col_stride];
      if constexpr (std::is_same_v<mask_t, bool>) {
        if (!v) s_row[c] = kNegInf;
      } else {
        s_row[c] += static_cast<float>(v) * kLog2e;  // scores are in base 2
      }
    }
  }
}

// Applies attn_mask (on a tile it reads) and the band (is_causal and the
// window, where the tile crosses its edges) to a tile of base-2 scores:
// hidden entries become -inf.
template <typename scalar_t>
void mask_scores(float* s, int64_t lds, const ForwardParams& p, int64_t batch, int64_t head,
                 const Tile& t, MaskTile mask_tile) {
  if (mask_tile == MaskTile::Read) {
    switch (p.mask.kind) {
      case MaskKind::None: break;
      case MaskKind::Bool: apply_mask<bool>(s, lds, p.mask, batch, head, t); break;
      case MaskKind::AdditiveFloat32: apply_mask<float>(s, lds, p.mask, batch, head, t); break;
      case MaskKind::AdditiveInput: apply_mask<scalar_t>(s, lds, p.mask, batch, head, t); break;
    }
  }
  if (tile_crosses_band(p, t)) {
    for (int64_t r = 0; r < t.rows; ++r) {
      // Query i sees keys [row_key_begin(i), row_key_end(i)) only.
      float* s_row = s + r * lds;
      const int64_t lo = std::clamp<int64_t>(row_key_begin(p, t.row0 + r) - t.col0, 0, t.cols);
      const int64_t hi = std::clamp<int64_t>(row_key_end(p, t.row0 + r) - t.col0, lo, t.cols);
      std::fill(s_row, s_row + lo, kNegInf);
      std::fill(s_row + hi, s_row + t.cols, kNegInf);
    }
  }
}

// Whether the tile needs mask_scores at all.
inline bool tile_needs_masking(const ForwardParams& p, const Tile& t, MaskTile mask_tile) {
  return mask_tile == MaskTile::Read || tile_crosses_band(p, t);
}

// The keys any query of rows [row0, row0 + rows) may see: [begin, end).
inline int64_t visible_key_begin(const ForwardParams& p, int64_t row0) { return row_key_begin(p, row0); }
inline int64_t visible_key_end(const ForwardParams& p, int64_t row0, int64_t rows) {
  return row_key_end(p, row0 + rows - 1);
}

}  // namespace fusedattn::cpu
