// A packed call's grid for the kernels that take both dense and packed calls
// (the sm80 forward, backward and dQ pass, the sm90 forward): a block's work
// item; fusedattn/sequence_rows.h says where the item's sequence lies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "block_order.h"
#include "fusedattn/params.h"
#include "fusedattn/sequence_rows.h"

namespace fusedattn::cuda {

// Block `index` of a packed call's grid over `items` (VarlenParams'
// query_tiles or key_tiles) and `heads` heads: pair = sequence x heads +
// head, block = the item's tile; the heads of one item are neighbours.
__device__ __forceinline__ GridBlock work_item(const int32_t* items, unsigned index, unsigned heads) {
  const unsigned item = index / heads;
  return {static_cast<unsigned>(items[2 * item]) * heads + index % heads, static_cast<unsigned>(items[2 * item + 1])};
}

// The blocks of a grid: order's, or a packed call's items x heads.
inline unsigned grid_blocks(const BlockOrder& order, bool packed, int64_t items, int64_t heads) {
  const int64_t blocks = packed ? items * heads : order.blocks();
  if (blocks > 2147483647) throw std::runtime_error("fusedattn: the call's blocks exceed one launch (2^31 - 1)");
  return static_cast<unsigned>(blocks);
}

}  // namespace fusedattn::cuda
