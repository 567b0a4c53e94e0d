// Host side of the sm90 family's TMA loads: a tensor map per operand.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Whether encode_head_tensor_map can describe the operand (the planner asks
// before it picks the sm90 family, so that its launchers never decline): a
// base and strides that are multiples of 16 bytes, no stride of 0, and every
// extent at least 1 (the driver's rules).
bool head_tensor_map_fits(const void* base, int64_t batch, int64_t heads, int64_t rows, int64_t head_dim,
                          const TensorStrides& strides);

// Describes a 16-bit [batch, heads, rows, head_dim] operand (last dim
// contiguous, other strides in elements) as the 4-D grid (head_dim, rows,
// heads, batch), loaded in boxes of 64 columns x box_rows rows into
// 128-byte-swizzled shared memory; rows past `rows` read as zeros. Returns
// false, leaving *map unspecified, where head_tensor_map_fits says no or the
// driver refuses.
bool encode_head_tensor_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch, int64_t heads,
                            int64_t rows, int64_t head_dim, const TensorStrides& strides, int box_rows);

// Describes `count` consecutive floats as a 1-D map loaded in boxes of `box`
// floats (no swizzle); elements past the end read as zeros. false where the
// driver refuses (a base not 16-byte aligned, say).
bool encode_rows_tensor_map(CUtensorMap* map, const float* base, int64_t count, int box);

// Describes a row-major float32 [rows, cols] matrix (cols a multiple of 32)
// in boxes of 32 columns (128 bytes, the swizzle's width) x box_rows rows,
// 128-byte-swizzled in shared memory: the layout tma_reduce_add_box adds from.
// false for 2^31 rows or more (the kernels' coordinates are int32) or where
// the driver refuses.
bool encode_float_matrix_tensor_map(CUtensorMap* map, const float* base, int64_t rows, int64_t cols, int box_rows);

}  // namespace fusedattn::cuda
