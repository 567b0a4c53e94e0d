// Host side of the Hopper kernels' TMA loads (the sm90 family's): a tensor map per operand.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "fusedattn/params.h"

namespace fusedattn::cuda {

// Describes a 16-bit [batch, heads, rows, head_dim] operand (last dim
// contiguous, other strides in elements) as the 4-D grid (head_dim, rows,
// heads, batch), loaded in boxes of 64 columns x box_rows rows into
// 128-byte-swizzled shared memory; rows past `rows` read as zeros. Returns
// why it cannot (the operand breaks a driver rule: a base or stride not a
// multiple of 16 bytes, a stride of 0, an extent of 0), empty when *map holds
// the map; throws std::runtime_error, with the driver's code and the map's
// arguments, where the driver refuses an operand that keeps those rules. The
// planner asks with a scratch map and the kernel's boxes before it picks the
// sm90 family, so that its launchers never decline.
std::string encode_head_tensor_map(CUtensorMap* map, DType dtype, const void* base, int64_t batch, int64_t heads,
                                   int64_t rows, int64_t head_dim, const TensorStrides& strides, int box_rows);

// The sm90 kernels' 16-bit operands as maps of encode_head_tensor_map:
// the forward's q (boxes of block_m rows), k and v (block_n rows; none where
// Nk = 0); the backward's q and grad_out (block_m), k and v (block_n). Returns
// the first that fails as "<operand>: <why>", empty when every map is written.
std::string encode_forward_operand_maps(const ForwardParams& p, CUtensorMap* q_map, CUtensorMap* k_map,
                                        CUtensorMap* v_map, int block_m, int block_n);
std::string encode_backward_operand_maps(const BackwardParams& p, CUtensorMap* q_map, CUtensorMap* grad_out_map,
                                         CUtensorMap* k_map, CUtensorMap* v_map, int block_m, int block_n);

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
