// Host side of the sm90 family's TMA loads: a tensor map per operand.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Describes a 16-bit [batch, heads, rows, head_dim] operand (last dim
// contiguous, other strides in elements) as the 4-D grid (head_dim, rows,
// heads, batch), loaded in boxes of 64 columns x box_rows rows into
// 128-byte-swizzled shared memory; rows past `rows` read as zeros. Returns
// false, leaving *map unspecified, when the tensor memory accelerator cannot
// express the operand (its base or a stride not a multiple of 16 bytes, a
// stride the driver refuses).
// Whether encode_head_tensor_map can describe the operand (the planner asks
// before it picks the sm90 family, so that its launchers never decline).
bool head_tensor_map_fits(const void* base, int64_t batch, int64_t heads, int64_t rows, int64_t head_dim,
                          const TensorStrides& strides);

bool encode_head_tensor_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch, int64_t heads,
                            int64_t rows, int64_t head_dim, const TensorStrides& strides, int box_rows);

// Describes `count` consecutive floats as a 1-D map loaded in boxes of `box`
// floats (no swizzle); elements past the end read as zeros. false where the
// driver refuses (a base not 16-byte aligned, say).
bool encode_rows_tensor_map(CUtensorMap* map, const float* base, int64_t count, int box);

}  // namespace fusedattn::cuda
